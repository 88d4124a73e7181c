"""Job-backed processes: :class:`Process` with the API of :class:`multiprocessing.Process`.

``start()`` pickles the process object (cloudpickle, so lambdas, closures and
``__main__`` functions travel), asks the selected backend for a job running the
worker bootstrap, and returns. A monitor thread waits for the job to connect
back, sends it the object, prints what the job writes (prefixed with its name),
and records the exit code: the one the worker reports, or the backend's when the
job died without reporting (``-9`` after ``kill()``).

Messages on a job's connection after its two start frames (the prelude and the
process object), one frame each:

========= ========= ============= ===================== ===========================================
kind      code      direction     layout                meaning
========= ========= ============= ===================== ===========================================
output    ``o``/``e`` job -> parent code + bytes          what the job wrote to fd 1 / fd 2
exit      ``x``     job -> parent ``x`` + ASCII integer the job's exit code
interrupt ``i``     parent -> job ``i``                 the parent got SIGINT: raise it in the job
========= ========= ============= ===================== ===========================================
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import weakref
from collections.abc import Callable, Sequence

from fiber_core.base.errors import FiberError, JobStartError
from fiber_core.base.fds import OUT_OF_DESCRIPTORS, limit_error
from fiber_core.base.log import log, tail
from fiber_core.contract.env import (
    JOB_ENV_KEYS,
    check_job_env,
    group_token,
)
from fiber_core.processes import main_code, spares
from fiber_core.processes.host import (
    OUTPUT_TAIL_LINES,
    BaseProcess,
    _close_fds,
    _exit_children,
    _forward_sigint,
    _log_settings,
    _main_reference,
    _MainProcess,
    _OutputPrinter,
    _ParentProcess,
    flush_std_streams,
)
from fiber_core.processes.host import cpu_count as cpu_count
from fiber_core.processes.jobspec import RESOURCES, job_spec
from fiber_core.runtime.config import config
from fiber_core.runtime.run import runtime, sending_to
from fiber_core.wire.framing import Connection, framed
from fiber_core.wire.messages import (
    PROCESS_EXIT,
    PROCESS_INTERRUPT,
    PROCESS_OBJECT,
    PROCESS_PRELUDE,
    PROCESS_STDERR,
    PROCESS_STDOUT,
    body,
    decode_process_exit,
    encode_process_object,
    encode_process_prelude,
    kind_of,
    unexpected,
)

TYPE_CHECKING = False  # typing's own, without importing typing: a job starts without it
if TYPE_CHECKING:
    from typing import Any, NoReturn

    from fiber_core.contract.backend import Backend, Job, JobSpec



_REPORT_GRACE = 10.0  # seconds the backend may lag behind a worker's own exit report


_EARLY_START = 1 << 16
"""Start frames up to this size go to a job connected at its launch (a channel) from the
launching thread: a socket pair's buffer holds them, so the send never waits for the job."""


_LOST_GRACE = 2.0  # seconds a TCP connection may outlive its job before it counts as stuck


_current: BaseProcess = _MainProcess()


_pickling = threading.local()  # the _JobRun whose process object is being pickled


def pickling_for() -> _JobRun | None:
    """The process being sent to its job right now, if any (so that objects pickled
    with it, like Pipe ends, can react when that process ends)."""
    return getattr(_pickling, "run", None)


_parent: _ParentProcess | None = None


def current_process() -> BaseProcess:
    """The Process object of the caller (``MainProcess`` in the program's first process)."""
    return _current


def parent_process() -> BaseProcess | None:
    """The parent of the caller, or ``None`` in the main process."""
    return _parent


def active_children() -> list[Process]:
    """The started children of this process that have not finished (joins finished ones)."""
    rt = runtime()
    out = []
    for p in list(rt.children):
        if p.is_alive():
            out.append(p)
        else:
            rt.children.discard(p)
    return out


class Process(BaseProcess):
    """A process that runs as a job on the selected backend.

    Same constructor and methods as :class:`multiprocessing.Process`. Fiber adds
    keyword-only options: ``backend`` (a backend name for this process only) and
    the resources ``cpu``, ``memory`` (MiB), ``gpu``, ``gpu_type`` (one type, or several in
    order of preference) and ``capacity`` (``"spot"``, ``"on-demand"``,
    ``"spot-then-on-demand"``), which default to what :func:`fiber_core.meta` put on the
    target, then to configuration,
    and the job's environment choices ``env``, ``env_pass``, ``env_exclude``, ``secret_env``
    (as :func:`fiber_core.meta` takes them; they replace the target's).
    """

    _start_method = "fiber"

    def __init__(self, group: None = None, target: Any = None, name: str | None = None,
                 args: tuple = (), kwargs: dict | None = None, *, daemon: bool | None = None,
                 backend: str | None = None, **resources: Any) -> None:
        if group is not None:
            raise ValueError("group argument must be None for now")
        unknown = set(resources) - set(RESOURCES) - {"image", *JOB_ENV_KEYS}
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {', '.join(sorted(unknown))}")
        resources.update(check_job_env({k: resources.pop(k) for k in JOB_ENV_KEYS if k in resources}, "Process"))
        parent = current_process()
        self._identity = parent._identity + (runtime().next_identity(),)  # noqa: SLF001 - the stdlib's process identity, kept as its own attribute for compatibility
        self._name = name or f"{type(self).__name__}-{':'.join(map(str, self._identity))}"
        self._daemon = parent.daemon if daemon is None else bool(daemon)
        self._target = target
        self._args = tuple(args)
        self._kwargs = dict(kwargs or {})
        self._backend_name = backend
        self._resources = {k: v for k, v in resources.items() if v is not None}
        if "gpu_type" in self._resources or "capacity" in self._resources:  # a bad one fails here, not at start
            from fiber_core.contract.placement import check_placement  # only when it names them

            check_placement(self._resources.get("gpu_type"), self._resources.get("gpu"),
                            self._resources.get("capacity"))
        self._parent_pid = os.getpid()
        self._run: _JobRun | None = None
        self._closed = False

    @property
    def resources(self) -> dict[str, Any]:
        """What this process's job got (``current_process().resources`` in its target); only
        the process itself knows it."""
        if _current is not self:
            raise ValueError(f"{self.name}: what a job got is known inside it: read "
                             "current_process().resources in its target")
        return super().resources

    # -- what runs in the job ---------------------------------------------------------

    def run(self) -> None:
        """Method representing the process's activity: calls the target. Override it."""
        target = getattr(self, "_target", None)  # dropped by start() in the parent
        if target:
            target(*self._args, **self._kwargs)

    # -- lifecycle (in the parent) -----------------------------------------------------

    def _check_closed(self) -> None:
        if self._closed:
            raise ValueError("process object is closed")

    def start(self) -> None:
        """Start the job. Returns as soon as the backend accepted it."""
        self._check_startable()
        active_children()  # reap, as multiprocessing does
        run = _JobRun(self)
        run.start()
        self._started(run)

    def _check_startable(self) -> None:
        self._check_closed()
        if self._run is not None:
            raise AssertionError("cannot start a process twice")
        if self._parent_pid != os.getpid():
            raise AssertionError("can only start a process object created by current process")
        if current_process().daemon:
            raise AssertionError("daemonic processes are not allowed to have children")

    def _started(self, run: _JobRun) -> None:
        self._run = run
        # As multiprocessing does: the job has its own copy; keep no reference here.
        del self._target, self._args, self._kwargs
        rt = runtime()
        rt.children.add(self)
        rt.at_shutdown(_exit_children)
        _forward_sigint()

    def terminate(self) -> None:
        """Stop the job with SIGTERM (or the backend's equivalent). Idempotent."""
        self._check_closed()
        if self._run is not None:
            self._run.stop(force=False)

    def kill(self) -> None:
        """Stop the job with SIGKILL (or the backend's equivalent). Idempotent."""
        self._check_closed()
        if self._run is not None:
            self._run.stop(force=True)

    def interrupt(self) -> None:
        """Send the job SIGINT, as Python 3.14's ``Process.interrupt()`` does: its main thread
        gets ``KeyboardInterrupt`` (or the handler the job installed), so ``finally`` clauses
        run; uncaught, the job ends with exit code 1. On every Python and backend: the signal
        travels on the job's connection (or once it has connected). A no-op on a job that
        has ended or not started.

        Unlike the stdlib's, it works on a job of a program whose SIGINT is ignored (started
        under ``nohup``, or in the background of a non-interactive shell): every job starts
        with Python's own SIGINT handler, whatever it inherited, so an interrupt that was
        asked for is not lost (a stdlib child inherits ``SIG_IGN`` and then ignores it). A job
        that wants SIGINT ignored says so itself with ``signal.signal()``."""
        self._check_closed()
        if self._run is not None:
            self._run.interrupt()

    def join(self, timeout: float | None = None) -> None:
        """Wait until the job ends, or ``timeout`` seconds pass."""
        self._check_closed()
        if self._parent_pid != os.getpid():
            raise AssertionError("can only join a child process")
        if self._run is None:
            raise AssertionError("can only join a started process")
        if self._run.finished.wait(timeout):
            runtime().children.discard(self)

    def is_alive(self) -> bool:
        self._check_closed()
        if self is _current:
            return True
        if self._run is None:
            return False
        return not self._run.finished.is_set()

    def close(self) -> None:
        """Release resources; the process must have finished."""
        if self._run is not None:
            if not self._run.finished.is_set():
                raise ValueError("Cannot close a process while it is still running. "
                                 "You should first call join() or terminate().")
            self._run.close()
        self._closed = True

    @property
    def exitcode(self) -> int | None:
        if self is _current:
            return None
        self._check_closed()
        return None if self._run is None else self._run.exitcode

    @property
    def pid(self) -> int | str | None:
        if self is _current:
            return os.getpid()
        self._check_closed()
        if self._run is None or self._run.job is None:
            return None
        jid = self._run.job.id
        return int(jid) if jid.isdigit() else jid

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the process ends."""
        self._check_closed()
        if self._run is None:
            raise ValueError("process not started")
        return self._run.sentinel_r

    @property
    def job(self) -> Job | None:
        """The backend's :class:`~fiber_core.contract.backend.Job` (Fiber extension)."""
        return None if self._run is None else self._run.job

    def log_tail(self, lines: int = 20) -> str:
        """The end of the job's log (Fiber extension): what Fiber noted about the job, else
        what its backend kept; "" for a process not started."""
        return "" if self._run is None else self._run.log_tail(lines)

    def job_logs(self) -> str:
        """What Fiber noted about the job so far, whole (Fiber extension; "" if nothing)."""
        return "" if self._run is None else self._run.logs

    def connected(self) -> bool:
        """Whether the job has reached its parent (Fiber extension): started, connected and
        sent for its process object."""
        return self._run is not None and self._run.connected.is_set()

    def joinable(self) -> bool:
        """Whether :meth:`join` may be called: started here and not closed."""
        return self._run is not None and not self._closed

    def output_tail(self, lines: int = OUTPUT_TAIL_LINES) -> list[str]:
        """The last ``lines`` lines the process printed, stdout and stderr as they came
        (Fiber extension): at most :data:`OUTPUT_TAIL_LINES`, each at most
        300 characters, escape sequences and control characters
        removed. Empty before it starts, and with ``forward_output`` off."""
        return [] if self._run is None else self._run.output.tail(lines)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_run"] = None
        return state

    def __repr__(self) -> str:
        if self._closed:
            status = "closed"
        elif self._run is None:
            status = "initial"
        elif self._run.exitcode is not None:
            status = f"stopped exitcode={self._run.exitcode}"
        else:
            status = "started"
        daemon = " daemon" if self._daemon else ""
        return f"<{type(self).__name__} name={self._name!r} {status}{daemon}>"

    # -- in the job ----------------------------------------------------------------

    def _bootstrap(self) -> int:
        """Run the process in its job; return the exit code, like multiprocessing's."""
        try:
            self.run()
            return 0
        except SystemExit as e:
            if e.code is None:
                return 0
            if isinstance(e.code, int):
                return e.code
            sys.stderr.write(str(e.code) + "\n")
            return 1
        except BaseException:
            import traceback  # only to report an error

            sys.stderr.write(f"Process {self.name}:\n")
            traceback.print_exc()
            return 1
        finally:
            flush_std_streams()


class _JobRun:
    """The parent's side of one started process: its job and monitor thread."""

    def __init__(self, process: Process) -> None:
        # The Process holds its run; a reference back would make a cycle, and the run's
        # descriptors would wait for the cyclic garbage collector instead of the Process.
        self._process = weakref.ref(process)
        self.name = process.name
        self.job: Job | None = None
        self.backend: Backend | None = None
        self.exitcode: int | None = None
        self.reported: int | None = None
        self.logs = ""
        self.finished = threading.Event()
        self.connected = threading.Event()
        self.sock: socket.socket | None = None
        # One descriptor where the system has eventfd (a pipe takes two): readable once written.
        if hasattr(os, "eventfd"):
            self.sentinel_r = self._sentinel_w = os.eventfd(0, os.EFD_CLOEXEC)
        else:
            self.sentinel_r, self._sentinel_w = os.pipe()
        # Closed by close(), or when the Process is garbage-collected, as multiprocessing does.
        self._close_fds = weakref.finalize(self, _close_fds, *{self.sentinel_r, self._sentinel_w})
        self._stopping = False
        self._on_finish: list[Callable[[], None]] = []
        self._send_lock = threading.Lock()
        self._started = False  # the start frames are sent: other frames may follow
        self._interrupt = False  # SIGINT came before they were
        self._spares_after: tuple[JobSpec, bytes] | None = None  # after a single start()
        self.output = _OutputPrinter(self.name)

    @property
    def process(self) -> Process:
        """The process being started (the caller of :meth:`start` holds it)."""
        p = self._process()
        assert p is not None, "a process is garbage-collected while it starts"
        return p

    def _spec(self, backend: Backend, token: str, hub: str, group: tuple[str, int] | None) -> JobSpec:
        p = self.process
        target_meta = getattr(p._target, "__fiber_meta__", None) or getattr(p, "__fiber_meta__", None) or {}  # noqa: SLF001 - _JobRun is the Process's own start machinery, in this module
        return job_spec(p.name, target_meta, p._resources, backend, token, hub, group)  # noqa: SLF001 - _JobRun is the Process's own start machinery, in this module

    def start(self) -> None:
        """Start the job: on a spare of its kind when one is ready (:mod:`.spares`), else
        through the backend. Once it has been sent the process, spares are replenished."""
        spec, (prelude, obj) = self.prepare()
        backend = self.backend
        assert backend is not None
        try:
            spare = spares.claim(backend, spec, prelude) if spares.wanted(backend) else None
            job = backend.start_job(spec) if spare is None else self._take(spare)
        except BaseException as e:
            self._abandoned(e)
        self._spares_after = (spec, prelude)
        self.launched(job, (None if spare is not None else prelude, obj))

    def start_on_spare(self) -> tuple[Job, tuple[None, bytes]] | None:
        """In a group start: take a ready spare of this process's kind if there is one;
        its job and what it is still to be sent (the process object), else ``None``."""
        spec, (prelude, obj) = self.prepare()
        assert self.backend is not None
        try:
            spare = spares.claim(self.backend, spec, prelude)
        except BaseException as e:
            self._abandoned(e)
        if spare is None:
            self.forget()
            return None
        return self._take(spare), (None, obj)

    def _abandoned(self, error: BaseException) -> NoReturn:
        """The job did not start: :meth:`abandon` it and raise (the clearer error, if any,
        chained to ``error``)."""
        clear = self.abandon(error)
        if clear is error:
            raise error
        raise clear from error

    def _take(self, spare: spares.Spare) -> Job:
        """Run on ``spare``, connected and sent this run's prelude: its job (after :meth:`prepare`)."""
        assert spare.job is not None and spare.sock is not None
        self.forget()
        self.token = spare.token
        self._on_connect("", spare.sock)
        return spare.job

    def prepare(self, group: tuple[str, int] | None = None) -> tuple[JobSpec, tuple[bytes, bytes]]:
        """Everything before the backend's call: the job's spec, and what it is sent once
        it connects. Until :meth:`launched` or :meth:`abandon`, it is registered with the hub.
        ``group``: the group's secret and this job's place in it, when started in a group."""
        rt = runtime()
        p = self.process
        self.backend = backend = rt.get_backend(p._backend_name)  # noqa: SLF001 - _JobRun is the Process's own start machinery, in this module
        token = group_token(*group) if group is not None else os.urandom(16).hex()
        # Two frames: a prelude of plain data the job applies first (sys.path, the
        # main module), then the process object, which may need both to unpickle.
        main = _main_reference()
        prelude = encode_process_prelude({
            "sys_path": sys.path,
            "main": main,
            "main_code": main_code.compiled(main),
            "config": config.snapshot(),
            "forward_output": config.get("forward_output"),
            "parent": (_current.name, os.getpid()),
            "argv": sys.argv,  # as spawn does: a main module may read it at import
            "log": _log_settings(),
        })
        addresses = rt.addresses_for(backend)
        _pickling.run = self
        try:
            with sending_to(addresses):
                payload = (prelude, encode_process_object(p))
        finally:
            _pickling.run = None
        hub = rt.hub
        hub.register(f"proc:{token}", self._on_connect)
        self.token = token
        return self._spec(backend, token, addresses, group), payload

    def abandon(self, error: BaseException) -> BaseException:
        """The backend did not start the job: forget its route; the error to raise."""
        self.forget()
        if isinstance(error, OSError) and error.errno in OUT_OF_DESCRIPTORS:
            return limit_error(error, f"cannot start {self.name}")
        if isinstance(error, FiberError) or not isinstance(error, Exception):
            return error
        backend = self.backend.name if self.backend is not None else "?"
        return JobStartError(f"could not start {self.name} on the {backend} backend: {error}")

    def forget(self) -> None:
        """Remove the route :meth:`prepare` registered (the job will never connect)."""
        runtime().hub.unregister(f"proc:{self.token}")

    def launched(self, job: Job, payload: tuple[bytes | None, bytes]) -> None:
        """The backend started the job: watch it, and send ``payload`` once it connects."""
        self.send_early(job, payload)
        self.watch(payload)

    def send_early(self, job: Job, payload: tuple[bytes | None, bytes]) -> None:
        """The backend started the job: if it is connected already (a channel), send it
        ``payload`` now, with no wait for the monitor thread to be scheduled."""
        self.job = job
        spares.take_channel(job, self._on_connect)
        if self.sock is not None and sum(len(p) for p in payload if p is not None) <= _EARLY_START:
            try:
                self._send_start(Connection(self.sock), payload)
            except OSError:
                pass  # the monitor finds the connection ended

    def watch(self, payload: tuple[bytes | None, bytes]) -> None:
        """Watch the job from a thread of its own, which sends ``payload`` once it connects
        (if :meth:`send_early` could not)."""
        threading.Thread(target=self._monitor, args=(payload,), daemon=True,
                         name=f"fiber-monitor-{self.name}").start()

    def _send_start(self, conn: Connection, payload: tuple[bytes | None, bytes]) -> None:
        """Send the start frames, once: the prelude (a spare has it), the process object, and
        a SIGINT that came before them."""
        with self._send_lock:
            if self._started:
                return
            if payload[0] is not None:
                conn.send_frame(PROCESS_PRELUDE, payload[0])
            conn.send_frame(PROCESS_OBJECT, payload[1])
            self._started = True
            if self._interrupt:
                conn.send_frame(PROCESS_INTERRUPT)

    def _on_connect(self, target: str, sock: socket.socket) -> None:
        if self.connected.is_set():
            sock.close()
            return
        self.sock = sock
        self.connected.set()

    def _wait_connected(self) -> int | None:
        """Wait for the job to connect; return its exit code if it ended first."""
        assert self.backend is not None and self.job is not None
        timeout = config.get("start_timeout") or None
        code, timed_out = spares.wait_connected(self.backend, self.job, self.connected, timeout)
        if timed_out:
            self.logs = f"fiber: the job did not reach its parent within start_timeout={timeout}s"
            self.backend.stop_job(self.job, force=True)
            return self.backend.wait_for_job(self.job, 30.0) or -signal.SIGKILL
        return code

    def _monitor(self, payload: tuple[bytes | None, bytes]) -> None:
        assert self.backend is not None and self.job is not None
        backend, job = self.backend, self.job
        try:
            early = self._wait_connected()
            if early is not None:
                tail = self.log_tail()
                if not self._stopping:
                    log.warning("fiber: %s exited with code %s before it started%s", self.name,
                                early, (":\n" + tail) if tail else "")
                if backend.poll_job(job) is not None:
                    backend.untrack_job(job)  # it ended: cleanup at exit need not look at it
                self._finish(early)
                return
            assert self.sock is not None
            conn = Connection(self.sock)
            printer = self.output
            conn_done = threading.Event()
            if self.sock.family != socket.AF_UNIX:
                threading.Thread(target=self._unstick, args=(self.sock, conn_done), daemon=True,
                                 name=f"fiber-unstick-{self.name}").start()
            try:
                self._send_start(conn, payload)
                del payload
                if self._spares_after is not None:  # now, not sooner: not while this one starts
                    self._replenish(*self._spares_after)
                while True:
                    msg = conn.recv_bytes()
                    kind = kind_of(msg)
                    if kind == PROCESS_EXIT:
                        self.reported = decode_process_exit(msg)
                    elif kind == PROCESS_STDOUT or kind == PROCESS_STDERR:
                        printer.write(kind, body(msg))
                    else:
                        raise unexpected(msg, f"the connection of {self.name}")
            except (EOFError, OSError):
                pass
            finally:
                conn_done.set()
                printer.flush()
                conn.close()
            code = backend.wait_for_job(job, _REPORT_GRACE if self.reported is not None else 60.0)
            if code is None and self.reported is None:
                backend.stop_job(job, force=True)  # it went silent: Fiber ends it
                code = backend.wait_for_job(job, 30.0)
            if code is not None:
                backend.untrack_job(job)
            self._finish(code if code is not None else self.reported)
        except Exception as e:  # the monitor must always finish the process
            log.exception("fiber: monitor of %s failed", self.name)
            self.logs = self.logs or str(e)
            self._finish(self.reported if self.reported is not None else 1)

    def _replenish(self, spec: JobSpec, prelude: bytes) -> None:
        self._spares_after = None
        assert self.backend is not None
        try:
            spares.replenish(self.backend, spec, prelude)
        except Exception as e:  # the process has started: a spare is only for the next one
            log.debug("fiber: no spare job after %s: %s", self.name, e)

    def _unstick(self, sock: socket.socket, conn_done: threading.Event) -> None:
        """End the connection of a job that the backend saw end while the connection stays open.

        A job on a machine that became unreachable sends no FIN. The connection's
        keepalives end it after ``peer_timeout``; the backend usually knows sooner
        (the ssh backend within seconds, Kubernetes from the pod's status), and then
        a Pool replaces the job that much sooner. (A Unix socket's peer is on this
        machine: its connection ends with it.)
        """
        assert self.backend is not None and self.job is not None
        self.backend.wait_for_job(self.job)
        if not conn_done.wait(_LOST_GRACE):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def log_tail(self, lines: int = 20) -> str:
        """The end of the job's log: what Fiber noted about it, else what the backend kept."""
        if not self.logs and self.backend is not None and self.job is not None:
            try:
                self.logs = self.backend.get_job_logs(self.job) or ""  # "" or None: none yet
            except Exception as e:
                return f"(the job's logs could not be read: {e})"
        return tail(self.logs, lines)

    def interrupt(self, wait: bool = True) -> bool:
        """Have the job raise SIGINT in itself (now, or as soon as it has started).

        With ``wait=False`` (in a signal handler) it neither waits for the lock nor
        blocks on a full socket, and returns False if it could not do it at once.
        """
        if not self._send_lock.acquire(wait):
            return False
        try:
            if self.finished.is_set():
                return True
            if not self._started or self.sock is None:
                self._interrupt = True
                return True
            frame = framed(PROCESS_INTERRUPT)
            try:
                if wait:
                    self.sock.sendall(frame)
                elif self.sock.send(frame, socket.MSG_DONTWAIT) < len(frame):
                    self.sock.sendall(frame)  # never half a frame
            except BlockingIOError:
                return False
            except OSError:
                pass
            return True
        finally:
            self._send_lock.release()

    def on_finish(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (in the monitor thread) once the process has ended."""
        self._on_finish.append(callback)

    def _finish(self, code: int | None) -> None:
        self.exitcode = 1 if code is None else code
        runtime().hub.unregister(f"proc:{self.token}")
        for callback in self._on_finish:
            try:
                callback()
            except Exception:
                log.exception("fiber: a finish callback of %s failed", self.name)
        self.finished.set()
        try:
            # Any value: it only makes the sentinel readable (an eventfd takes 8 bytes).
            os.write(self._sentinel_w, (1).to_bytes(8, sys.byteorder))
        except OSError:
            pass

    def stop(self, force: bool) -> None:
        if self.finished.is_set() or self.job is None or self.backend is None:
            return
        self._stopping = True
        self.backend.stop_job(self.job, force)

    def close(self) -> None:
        self._close_fds()  # once only: a second close must not hit a reused descriptor


if TYPE_CHECKING:
    _Started = tuple[_JobRun, Job, tuple[bytes | None, bytes]]  # a run, its job, what to send it


def _take_spares(backend: Backend, runs: list[_JobRun], done: list[_Started]) -> list[_JobRun]:
    """Start what ready spares of ``backend`` can take (added to ``done``); the rest."""
    rest = []
    trying = spares.any_ready(backend)
    for run in runs:
        taken = run.start_on_spare() if trying else None
        if taken is None:  # none of its kind: the others (a Pool's are all of one kind)
            # go to the backend too, each pickled once
            trying = False
            rest.append(run)
        else:
            done.append((run, *taken))
    return rest


def _start_group(backend: Backend, runs: list[_JobRun]) -> list[_Started]:
    """One group start of ``runs`` on ``backend``; if it raises, the runs are abandoned."""
    prepared: list[tuple[_JobRun, JobSpec, tuple[bytes, bytes]]] = []
    secret = os.urandom(16).hex() if len(runs) > 1 else None
    try:
        for i, run in enumerate(runs):
            spec, payload = run.prepare(None if secret is None else (secret, i))
            prepared.append((run, spec, payload))
        jobs = backend.start_jobs([spec for _, spec, _ in prepared])
    except BaseException as e:
        error: BaseException = e
        for run, _, _ in prepared:
            error = run.abandon(e)
        if error is e:
            raise
        raise error from e
    return [(run, job, payload) for (run, _, payload), job in zip(prepared, jobs)]


def _stop_unused(done: list[_Started]) -> None:
    """Spares taken and an earlier backend's jobs, when a later start failed: never used."""
    for run, job, _ in done:
        run.forget()
        try:
            job.state.stop_requested = True
            assert run.backend is not None
            run.backend.kill_job(job)
        except Exception:
            pass


def start_processes(processes: Sequence[Process]) -> None:
    """Start several processes with one group start per backend (``Backend.start_jobs``).

    As ``for p in processes: p.start()``, but the backend is asked for all the jobs
    of one backend in one call, which it may serve at once (AWS Batch array jobs,
    pods created concurrently, SSH hosts filled in parallel). All or nothing: when
    it raises, none of ``processes`` is started.
    """
    for p in processes:
        p._check_startable()  # noqa: SLF001 - start_processes is the Process's own start machinery, in this module
    if len({id(p) for p in processes}) != len(processes):
        raise ValueError("start_processes: a process is given twice")
    active_children()
    groups: dict[str | None, list[_JobRun]] = {}
    for p in processes:
        groups.setdefault(p._backend_name, []).append(_JobRun(p))  # noqa: SLF001 - start_processes is the Process's own start machinery, in this module
    done: list[_Started] = []
    try:
        for runs in groups.values():
            # Ready spares of the backend (a Process started before) become workers of the group.
            backend = runtime().get_backend(runs[0].process._backend_name)  # noqa: SLF001 - start_processes is the Process's own start machinery, in this module
            rest = _take_spares(backend, runs, done)
            if rest:
                done += _start_group(backend, rest)
    except BaseException:
        _stop_unused(done)
        raise
    for run, job, to_send in done:  # every job on a channel gets its start before any monitor
        run.send_early(job, to_send)  # thread starts: a thread's start waits until it runs
    for run, _, to_send in done:
        # The monitor first: where no thread can start (at exit, on CPython 3.12.0 and 3.12.1)
        # this raises, and no join then waits for a job that nobody watches.
        run.watch(to_send)
        run.process._started(run)  # noqa: SLF001 - start_processes is the Process's own start machinery, in this module
