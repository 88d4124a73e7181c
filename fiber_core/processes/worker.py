"""The worker bootstrap: what every job runs (``python -m fiber_core.processes.worker``).

It dials the parent named in ``FIBER_PARENT_HUB``, authenticates with the run's
key, receives the pickled process object, runs it and reports the exit code.
Once it has read the key and its token, they leave its environment
(``SECRET_VARIABLES``), so a program that the job starts does not inherit them.
While it runs, fds 1 and 2 go through pipes whose contents are sent to the
parent (which prints them prefixed with the process name) and also written to
the job's own stdout/stderr, where the backend keeps its logs. When the parent
goes away, the job kills itself and everything it started: a thread sees the
connection to the parent end; and when the parent is on this machine
(``FIBER_PARENT_PID``), a small process forked at start waits on the parent's pid,
so that a job inside a long call that holds the interpreter ends at once too (a job
forked by the local backend's template has the template wait on it for all its jobs).
"""

from __future__ import annotations

import multiprocessing
import os
import select
import signal
import socket
import sys
import threading

from fiber_core.base import environ, rundirs
from fiber_core.contract.env import (
    ENV_HUB,
    ENV_PARENT_CHANNEL,
    ENV_PARENT_PID,
    ENV_PARENT_RUNDIR,
    SECRET_VARIABLES,
    job_token,
)
from fiber_core.processes import host, main_code
from fiber_core.processes import process as process_mod
from fiber_core.runtime.config import config
from fiber_core.runtime.hub import dial
from fiber_core.runtime.run import runtime
from fiber_core.wire.framing import Connection
from fiber_core.wire.messages import (
    PROCESS_INTERRUPT,
    PROCESS_STDERR,
    PROCESS_STDOUT,
    PROCESS_WAITING,
    decode_process_object,
    decode_process_prelude,
    encode_process_exit,
    kind_of,
)

TYPE_CHECKING = False  # typing's own, without importing typing: a job starts without it
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any


def _die_with_parent(conn, finishing: threading.Event, parent) -> None:  # noqa: ANN001
    try:
        while True:
            if kind_of(conn.recv_bytes()) == PROCESS_INTERRUPT:  # as if from the terminal
                # To the main thread, which runs the handler: a blocking call there ends.
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
    except (EOFError, OSError):
        pass
    parent.gone.set()
    if finishing.is_set():
        return
    _end_job()  # the parent is gone


def _end_job() -> None:
    """Kill this job and everything it started (it leads its process group when local)."""
    try:
        if os.getpgid(0) == os.getpid():
            os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(1)


_watcher_pipe: int | None = None  # held open while this job lives: the watcher waits for its end


def _watch_parent_outside(parent: int) -> None:
    """Fork a process that kills this job the moment ``parent`` (a process here) ends.

    A thread of this interpreter cannot do it while the job's code holds the
    interpreter (a long call in C): the watcher is another process, blocked in the
    kernel on the parent's pid. It ends with the job, which holds a pipe to it open.
    Called before any thread starts, so the fork is safe.
    """
    global _watcher_pipe
    if os.getppid() != parent:
        _end_job()  # the parent ended before this job could watch it
    try:
        pidfd = os.pidfd_open(parent)
    except ProcessLookupError:
        _end_job()
    except (AttributeError, OSError):
        return  # no pidfd here (before Linux 5.3): the thread watching the connection only
    job = os.getpid()
    r, w = os.pipe()
    if os.fork() == 0:
        try:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)  # what stops the job reaches it; it ends with the job
            os.close(w)
            while True:
                try:
                    ready, _, _ = select.select([pidfd, r], [], [])
                    break
                except InterruptedError:
                    continue
            if pidfd in ready:  # the parent ended (and the job is still there: r is open)
                if os.getpgid(0) == job:
                    os.killpg(job, signal.SIGKILL)  # the job, what it started, and this watcher
                else:
                    os.kill(job, signal.SIGKILL)
        finally:
            os._exit(0)
    os.close(r)
    os.close(pidfd)
    _watcher_pipe = w


class _Pump:
    """Copies what the job writes to one of its fds to the parent (and to the fd's saved copy).

    A thread waits for data; whoever holds :attr:`lock` reads and sends, so :meth:`drain`
    (the pool worker, before it sends results) sends what is left in the pipe itself, after
    whatever the thread had already read: output a task printed reaches the parent before
    its result, and a worker killed once its results are in loses none of it.
    """

    def __init__(self, fd: int, kind: bytes, conn: Connection, lock: threading.Lock) -> None:
        self.saved = os.dup(fd)
        self.r, w = os.pipe()
        os.dup2(w, fd)
        os.close(w)
        os.set_blocking(self.r, False)
        self.kind, self.conn, self.send_lock = kind, conn, lock
        self.lock = threading.Lock()
        self.ready = select.poll()  # for drain(): whether anything is left to send
        self.ready.register(self.r, select.POLLIN)
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"fiber-forward-{fd}")
        self.thread.start()

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self.r, select.POLLIN)
        while True:
            poller.poll()
            with self.lock:
                if not self._pass():
                    break
        os.close(self.r)

    def _pass(self) -> bool:
        """Read and send what the pipe holds (under :attr:`lock`); False at its end."""
        while True:
            try:
                chunk = os.read(self.r, 65536)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not chunk:
                return False
            try:
                os.write(self.saved, chunk)
            except OSError:
                pass
            try:
                with self.send_lock:
                    self.conn.send_frame(self.kind, chunk)
            except OSError:
                pass

    def drain(self) -> None:
        with self.lock:  # taken: a chunk the thread read is sent by now
            try:
                if self.ready.poll(0):  # (on an empty pipe, a read would raise)
                    self._pass()
            except OSError:  # the pipe was closed at the job's end
                pass


def _import_main(ref: tuple[str, str] | None, shipped: main_code.Shipped | None = None) -> None:
    """Import the program's main module as ``__mp_main__``, as multiprocessing's spawn does.

    Its ``if __name__ == "__main__":`` block does not run. Skipped when the module
    is not reachable from the job (another machine, no shared files). A source file
    runs the code the parent compiled (``shipped``) where it is the same file
    (:func:`main_code.code_for`).
    """
    if ref is None:
        return
    import types  # only to import a main module

    kind, where = ref
    try:
        if kind == "name":
            import importlib  # only to import a main module

            module = importlib.import_module(where)
        else:
            if not os.path.isfile(where):
                return
            module = types.ModuleType("__mp_main__")
            module.__file__ = where
            sys.modules["__mp_main__"] = module
            if where.endswith((".py", ".pyw")):
                # What runpy.run_path does for a source file, without the import machinery it
                # loads for zip files and directories (pkgutil: a few ms of every job's start).
                with open(where, "rb") as f:
                    code = main_code.code_for(f.read(), where, shipped)
                exec(code, module.__dict__)  # noqa: S102 - the program's own main module
            else:
                import runpy  # a zip file or compiled file run as the main module

                module.__dict__.update(runpy.run_path(where, run_name="__mp_main__"))
    except Exception as e:
        sys.modules.pop("__mp_main__", None)
        sys.stderr.write(f"fiber worker: could not import the main module {where}: {e!r}\n")
        return
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def _set_logging(level: int, to_stderr: bool) -> None:
    """The parent's level and stderr handler for Fiber's logger, as spawn gives the stdlib's."""
    from fiber_core.base.log import (  # only when the parent logs: a job starts without logging
        get_logger,
        log_to_stderr,
    )

    get_logger().setLevel(level)
    if to_stderr:
        log_to_stderr()


class _SharedMemoryHook:
    """Keeps a job's resource tracker from unlinking shared memory the job only attached to.

    Under spawn a child reports to its parent's resource tracker, so a block it
    attaches to by name outlives it. A job has its own tracker, which unlinks at
    the job's end every block still registered: so blocks the job attaches to
    are not registered (those it creates still are). Installed as an import hook
    so that a job that does not use :mod:`multiprocessing.shared_memory` does not
    import it.
    """

    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if name != "multiprocessing.shared_memory":
            return None
        import importlib.util  # only to import a main module

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        class _Loader:
            def create_module(self, spec):  # noqa: ANN001, ANN202
                return loader.create_module(spec)

            def exec_module(self, module):  # noqa: ANN001, ANN202
                exec_module(module)
                _untrack_attached(module)

        spec.loader = _Loader()  # type: ignore[assignment]
        return spec


def _untrack_attached(shared_memory) -> None:  # noqa: ANN001
    tracker = shared_memory.resource_tracker
    register, unregister = tracker.register, tracker.unregister
    attaching = threading.local()
    untracked: set[str] = set()

    def tracked_register(name: str, rtype: str) -> None:
        if rtype == "shared_memory" and getattr(attaching, "on", False):
            untracked.add(name)
            return
        register(name, rtype)

    def tracked_unregister(name: str, rtype: str) -> None:
        if rtype == "shared_memory" and name in untracked:
            untracked.discard(name)
            return
        unregister(name, rtype)

    init = shared_memory.SharedMemory.__init__

    def __init__(self, name=None, create=False, size=0):  # noqa: ANN001, ANN202, N807
        attaching.on = not create
        try:
            init(self, name, create, size)
        finally:
            attaching.on = False

    tracker.register, tracker.unregister = tracked_register, tracked_unregister
    shared_memory.SharedMemory.__init__ = __init__


def _join_threads() -> None:
    """Wait for the target's non-daemon threads, as a process of the stdlib does before it exits."""
    me = threading.current_thread()
    while True:
        waiting = [t for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()]
        if not waiting:
            return
        for thread in waiting:
            thread.join()


def _keep_temp_files_in_the_parents_run_dir() -> None:
    """On the parent's machine, multiprocessing's temp files (a manager's socket, ...) go in the
    parent's run directory, which the parent's exit removes however this job ends; elsewhere
    they go where the stdlib puts them (``pymp-*``), removed by :func:`_exit` on a clean end."""
    inside = rundirs.usable(os.environ.get(ENV_PARENT_RUNDIR))
    if inside is not None and len(inside) <= _TEMPDIR_MAX:
        multiprocessing.current_process()._config.setdefault("tempdir", inside)  # type: ignore[attr-defined]  # noqa: SLF001 - the stdlib's per-process config, where its tempdir is looked up


_TEMPDIR_MAX = 80
"""The longest parent run directory that multiprocessing's temp files go in: a listener's
socket there (``/listener-`` and 8 characters) must fit a Unix socket's path (104 bytes on
some systems). Past it, they go where the stdlib puts them."""


def _exit() -> None:
    """What a process of the stdlib runs when its target returns, then this process's run exit.

    multiprocessing's exit finalizers (a manager's shutdown, removing its ``pymp-*`` temp
    dir, joining its own children), as ``BaseProcess._bootstrap`` runs them; then Fiber's
    exit sequence for the processes this job started (its own run directory goes).
    """
    # Only if loaded: a job that registered no finalizer, started no stdlib process and made
    # no temp dir never imported it, and importing it at the end costs every job ~2 ms.
    util = sys.modules.get("multiprocessing.util")
    exit_function = getattr(util, "_exit_function", None)
    if exit_function is not None:
        try:
            exit_function()
        except Exception:
            import traceback  # only to report an error

            traceback.print_exc()
    runtime().shutdown()


def _apply_prelude(data: dict[str, Any]) -> None:
    """Make this interpreter the parent's: its paths, argv, logging, config, main module."""
    for entry in data["sys_path"]:
        if entry not in sys.path and (entry == "" or os.path.isdir(entry)):
            sys.path.append(entry)
    if "argv" in data:
        sys.argv = list(data["argv"])  # before the main module runs, as spawn does
    if data.get("log"):
        _set_logging(*data["log"])
    sys.meta_path.insert(0, _SharedMemoryHook())
    _import_main(data.get("main"), data.get("main_code"))
    config.restore(data["config"])


def _load(conn: Connection) -> tuple[dict[str, Any], Any] | int:
    """The prelude and the process object to run, or the exit code of a job that runs none."""
    try:
        data = decode_process_prelude(conn.recv_bytes())
        _apply_prelude(data)
        if data.get("spare"):  # started ahead (spares.py): say it is ready, then wait
            conn.send_frame(PROCESS_WAITING)
        try:
            frame = conn.recv_bytes()
        except EOFError:  # a spare job let go: it ran nothing
            return 0
        return data, decode_process_object(frame)
    except Exception:
        # Output is not forwarded yet: send the reason itself, or only the job's log has it.
        import traceback

        text = "fiber worker: cannot load the process to run:\n" + traceback.format_exc()
        sys.stderr.write(text)
        try:
            conn.send_frame(PROCESS_STDERR, text.encode("utf-8", "replace"))
            conn.send_frame(encode_process_exit(1))
        except OSError:
            pass
        return 1


def _forward_output(conn: Connection, lock: threading.Lock) -> list[tuple[int, int, Any]]:
    """Send fds 1 and 2 to the parent too; (fd, its saved copy, the pump thread) for each."""
    sys.stdout.flush()
    sys.stderr.flush()
    pumps = [_Pump(fd, kind, conn, lock) for fd, kind in ((1, PROCESS_STDOUT), (2, PROCESS_STDERR))]
    host.output_pumps[:] = pumps  # for host.output_sent()
    forwards = [(fd, pump.saved, pump.thread) for fd, pump in zip((1, 2), pumps)]
    streams: tuple[Any, ...] = (sys.stdout, sys.stderr)  # reconfigure() if TextIOWrapper
    for stream in streams:
        try:
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        except (AttributeError, ValueError):
            pass
    return forwards


def _wind_up() -> None:
    """After the target: its children, its threads and exit finalizers, what it holds of others."""
    try:
        process_mod._exit_children()  # noqa: SLF001 - the job's bootstrap ends the children as the process module's exit does
    except Exception:
        pass
    _join_threads()
    _exit()
    queues = sys.modules.get("fiber_core.parallel.queues")  # only if this job used a queue
    if queues is not None:
        queues.settle()  # os._exit skips atexit: acknowledge the items this process took
    pipes = sys.modules.get("fiber_core.processes.pipe")  # only if this job holds a Pipe end
    if pipes is not None:
        pipes.settle()  # give back what was sent to this job's copies and not read


def _report_exit(code: int, conn: Connection, lock: threading.Lock,
                 forwards: list[tuple[int, int, Any]]) -> None:
    """Drain the forwarded output, then tell the parent the exit code."""
    process_mod.flush_std_streams()
    for fd, saved, _thread in forwards:
        os.dup2(saved, fd)  # closes the pipe's last writer: the pump sees EOF
    for _, _, thread in forwards:
        thread.join(2.0)
    try:
        with lock:
            conn.send_frame(encode_process_exit(code))
    except OSError:
        pass


def _parent_connection(hub: str, key: bytes, target: str) -> socket.socket:
    """The connection to the parent: the channel it handed down (a forked local job: see
    :mod:`fiber_core.backends.template` for why it needs no handshake), else dialed."""
    channel = os.environ.pop(ENV_PARENT_CHANNEL, "")
    if channel.isdigit():
        return socket.socket(fileno=int(channel))
    return dial(hub, key, target)


def main() -> int:
    # Process.interrupt() raises KeyboardInterrupt here wherever the job was started from: a
    # job started by a program whose SIGINT is ignored (under nohup, or as background work of
    # a non-interactive shell) inherits SIG_IGN, and an interpreter that starts so installs no
    # handler. The stdlib's child then ignores interrupt() and a join() waits forever; a job
    # gets the handler of a fresh interpreter instead, as a forked one (template.py) does.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rt = runtime()  # it reads the run's key
    try:
        hub, target = os.environ[ENV_HUB], f"proc:{job_token()}"
    except KeyError as e:
        sys.stderr.write(f"fiber worker: {e.args[0]} is not set; this module is run by fiber jobs only\n")
        return 2
    # Both read: what the job starts (a simulator, a shell command) must not inherit the key or
    # the token. Its own Fiber processes get the key from the runtime. Before the parent's
    # watcher is forked, which would keep a copy of the environment's block.
    environ.forget(SECRET_VARIABLES)
    if os.environ.get(ENV_PARENT_PID, "").isdigit():
        _watch_parent_outside(int(os.environ[ENV_PARENT_PID]))
    _keep_temp_files_in_the_parents_run_dir()
    try:
        sock = _parent_connection(hub, rt.authkey, target)
    except Exception as e:
        sys.stderr.write(f"fiber worker: cannot reach the parent process: {e}\n")
        return 3
    conn = Connection(sock)
    loaded = _load(conn)
    if isinstance(loaded, int):
        return loaded
    data, proc = loaded
    parent = process_mod._ParentProcess(data["parent"][0], data["parent"][1], conn)  # noqa: SLF001 - the job's bootstrap installs its process objects, as the stdlib's does
    process_mod._current = proc  # noqa: SLF001 - the job's bootstrap installs its process objects, as the stdlib's does
    multiprocessing.current_process().name = proc.name  # what logging's %(processName)s shows
    process_mod._parent = parent  # noqa: SLF001 - the job's bootstrap installs its process objects, as the stdlib's does
    finishing = threading.Event()
    threading.Thread(target=_die_with_parent, args=(conn, finishing, parent), daemon=True,
                     name="fiber-parent-watch").start()
    lock = threading.Lock()
    forwards = _forward_output(conn, lock) if data["forward_output"] else []
    code = proc._bootstrap()  # noqa: SLF001 - the stdlib's name for running a process object, which Process keeps
    _wind_up()
    finishing.set()
    _report_exit(code, conn, lock, forwards)
    return code


if __name__ == "__main__":
    code = main()
    process_mod.flush_std_streams()
    os._exit(code & 0xFF if code >= 0 else 1)
