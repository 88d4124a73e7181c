"""Local jobs forked from a template process that has Fiber imported already.

A fresh interpreter spends most of a local job's start importing Fiber (about 50
ms of CPU each). The local backend instead starts, on first use, one *template*:
``python -m fiber_core.backends.template``, a clean process (never the parent's
state, as the stdlib's forkserver) that imports the worker's modules and then
forks one child per job. A child becomes the job exactly as if its command had
run: a process group of its own, without a controlling terminal (as a job started with a
session of its own has none), the job's environment and working directory, stdout and
stderr to the job's log, then the worker's ``main()``.

The template and its jobs stay in the parent's session (a process group of their own, so
that a terminal's Ctrl-C reaches the parent only, which passes it on): where the kernel
groups each session's processes for the scheduler (``sched_autogroup_enabled``), the jobs
then share their CPUs with the parent as :mod:`multiprocessing`'s workers do. The template
gives up the session's terminal first (``TIOCNOTTY``), so that no job can be stopped by
reading it. On Python 3.10, which cannot start a process in a group of its own without a
``preexec_fn``, the template takes a session of its own.

The template talks to the backend over a Unix socket pair (its descriptor number is
the template's first argument):

backend -> template
    one request per job: a JSON line ``{"env": {...}, "cwd": ..., "module": ...}``,
    with the log file's descriptor attached (``SCM_RIGHTS``), and after it the job's end
    of the socket pair it talks to its parent on (``"channel": true``). Requests may follow
    each other without waiting for the answers (a group start sends all of its own).
template -> backend
    ``{"ready": true}`` once it has imported what it preloads; then ``{"pid": N}`` in answer to each request (``{"error": TEXT}`` if the fork
    failed), and ``{"exit": N, "code": C}`` when child N ended (C as
    :mod:`multiprocessing` has it: ``-9`` after SIGKILL).

The channel: the backend makes a socket pair per job and passes one end down, through
this template, to the one child forked for it (``FIBER_PARENT_CHANNEL`` names its
descriptor there). It has no address: nobody can connect to it, and only the parent, this
template (the parent's own child, started with a socket pair of the same kind) and the job
ever hold it. So it is authenticated by construction, as a pipe to a child is, and the
job skips the connection and the key's handshake that a job dialing its parent's hub
needs (a job still reads the key: it authenticates every other connection with it).

The template also watches the run's parent for its children (a pidfd): when the parent
ends, it kills every child's process group, as each job's own watcher process would
(:mod:`fiber_core.processes.worker`), which a forked job then does not fork; a child is
killed when the template ends (``PR_SET_PDEATHSIG``), as the backend kills the jobs of a
template it lost.

The template ends when the socket closes (its parent ended or cleaned up). It
preloads the worker module, the Pool's module (a pool worker imports it first: about
6 ms of CPU each, as much as the rest of its start), what a worker needs to unpickle
synchronization objects and queues (:data:`PRELOAD`) and the modules named by the
``forkserver_preload`` setting (``fiber_core.set_forkserver_preload``); what it needs to
unpickle a function sent by value only once no job was asked for a while (:data:`LATER`).
The local backend starts it when the run selects the backend (``warm_up``), so that it
imports while the program goes on; in the program's first process, where the backend will
likely be this one, even before the plugins that choose it are loaded
(:func:`fiber_core.backends.early.start_template_early`). The run selects its backend when
the program first makes a lock, a semaphore, a shared value, a queue, a Pool or a Process.
Jobs asked for while it imports wait for it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence

from fiber_core.contract.env import ENV_PARENT_CHANNEL, ENV_PARENT_PID

TYPE_CHECKING = False  # typing's own, without importing typing: the template starts without it
if TYPE_CHECKING:
    from typing import Any

_MAX_LINE = 1 << 24


# -- the template process --------------------------------------------------------------------

PRELOAD = ("fiber_core.processes.worker", "fiber_core.parallel.pool.worker",
           "fiber_core.parallel.synchronize", "fiber_core.parallel.queues", "resource")
"""What every template imports before it forks: the worker, the Pool's worker, what a
worker imports to unpickle its process object or its first task whenever they hold a lock,
a Barrier or a queue, and ``resource``, with which every job's runtime reads its descriptor
limit (an extension module: loading it cost each job half a millisecond of CPU)."""

LATER = ("cloudpickle", "fiber_core.processes.pipe", "fiber_core.parallel.context")
"""What the template imports once no request has come for :data:`LATER_IDLE_SECONDS`: what
a worker needs only for a function sent by value (a lambda, a closure), about 9 ms of CPU
that the program's first jobs do not wait for (one forked before imports it itself); and
the parts of the API that ``import fiber_core`` no longer loads and a job may use (a Pipe
end in its process object, a context), which the package's import gave the template before."""

LATER_IDLE_SECONDS = 1.0
"""How long the template waits for no request before it imports :data:`LATER`: long enough
that a Pool's starts, which come in runs as its workers get ready, are not held up by it
(importing between two runs cost a loaded machine's Pool(64) a few tenths of a second)."""


def _child(sock: socket.socket, wake_r: int, wake_w: int, request: dict, fds: list[int],
           parent_pidfd: int | None) -> None:
    """In the forked child: become the job, run it, never return."""
    code = 1
    try:
        sock.close()
        os.close(wake_r)
        os.close(wake_w)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
        os.setpgid(0, 0)  # (the template does it too, so that it is done when it answers)
        if parent_pidfd is not None:
            os.close(parent_pidfd)
            _die_with_template()
        logfd = fds[0]
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(logfd, 1)
        os.dup2(logfd, 2)
        for fd in (devnull, logfd):
            if fd > 2:
                os.close(fd)
        _become_environment(request["env"])
        util = sys.modules.get("multiprocessing.util")
        if util is not None:  # as for the stdlib's fork children: the template's exit work is not theirs
            util._finalizer_registry.clear()  # type: ignore[attr-defined]  # noqa: SLF001 - a forked child drops the template's exit work, as the stdlib's fork children do
            util.process.current_process()._config.pop("tempdir", None)  # type: ignore[attr-defined]  # noqa: SLF001 - a forked child drops the template's exit work, as the stdlib's fork children do
        if parent_pidfd is not None:  # the template watches the parent: no watcher of its own
            os.environ.pop(ENV_PARENT_PID, None)
        if len(fds) > 1:  # its end of the socket pair to its parent (see the module's docstring)
            os.environ[ENV_PARENT_CHANNEL] = str(fds[1])
        if os.environ.get("PYTHONUNBUFFERED"):  # what the interpreter would have made of it
            import io

            for fd, name, errors in ((1, "stdout", "strict"), (2, "stderr", "backslashreplace")):
                stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                                          errors=errors, write_through=True)
                setattr(sys, name, stream)
                setattr(sys, f"__{name}__", stream)
        if request.get("cwd"):
            os.chdir(request["cwd"])
        module = sys.modules[request["module"]]
        sys.argv = [request["module"]]
        code = module.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass
        os._exit(code & 0xFF if code >= 0 else 1)


def _become_environment(env: dict[str, str]) -> None:
    """Make ``os.environ`` exactly ``env`` (the job's), setting and removing only the
    variables where it differs from the template's: a job's environment is mostly its
    parent's, which the template has too, and each change is a call to the C library."""
    environ = os.environ
    for name in [name for name in environ if name not in env]:
        del environ[name]
    for name, value in env.items():
        if environ.get(name) != value:
            environ[name] = value


def _die_with_template() -> None:
    """In a child: be killed when the template ends, which watches the parent for it."""
    template = os.getppid()
    assert _prctl is not None, "serve() looks prctl up before it forks a child that calls this"
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != template:  # it ended before the call
        os._exit(1)


_PR_SET_PDEATHSIG = 1
_prctl: Callable[..., int] | None = None
"""The C library's ``prctl``, looked up once by the template that watches its parent (serve())."""


def _kill_children(children: set[int]) -> None:
    """The parent of the run ended: end every job (each leads its group) as it would have."""
    for pid in children:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass


def _recv_requests(sock: socket.socket, buf: bytearray, fds: list[int]) -> list[tuple[dict, list[int]]] | None:
    """The requests whose lines one read completes, each with its descriptors; None at end
    of stream. ``buf`` and ``fds`` keep what came of the next ones: a request's descriptors
    come with its first byte, so they are in ``fds``, in order, once its line is complete."""
    data, ancdata, _, _ = sock.recvmsg(65536, socket.CMSG_SPACE(4 * 4))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = [int.from_bytes(payload[i:i + 4], sys.byteorder) for i in range(0, len(payload) - 3, 4)]
            for fd in got:
                os.set_inheritable(fd, False)  # a child keeps its own by fork, never past an exec
            fds += got
    if not data:
        for fd in fds:
            os.close(fd)
        return None
    buf += data
    requests = []
    while b"\n" in buf:
        line, _, rest = bytes(buf).partition(b"\n")
        buf[:] = rest
        request = json.loads(line)
        count = 2 if request.get("channel") else 1
        if len(fds) < count:
            raise ValueError(f"a request carries {len(fds)} descriptors, not {count}")
        requests.append((request, fds[:count]))
        del fds[:count]
    if len(buf) > _MAX_LINE:
        raise ValueError("request too long")
    return requests


def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _preload(names: Sequence[str]) -> None:
    import importlib

    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # a job imports it again, and fails there with the real error
            sys.stderr.write(f"fiber template: cannot preload {name}: {e}\n")


def _open_parent_pidfd() -> int | None:
    """A pidfd of the parent of the run, which the template watches; None where there is none."""
    parent = os.environ.get(ENV_PARENT_PID, "")
    if parent.isdigit() and os.getppid() == int(parent):  # (else the parent has ended already)
        try:
            return os.pidfd_open(int(parent))
        except (AttributeError, OSError):
            pass  # no pidfd here: jobs watch their parent's connection only
    return None


def _reap(sock: socket.socket, children: set[int]) -> None:
    """Report every child that ended, whichever wakeup came."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _fork_job(sock: socket.socket, request: dict, fds: list[int], children: set[int],
              wake: tuple[int, int], parent_pidfd: int | None) -> None:
    """Fork the child for one request and answer with its pid, which leads its own group.

    Both the child and the template put it in its group (the usual way to have it done
    by whichever runs first), so the template answers at once: a signal to the group
    reaches the job from then on, as after ``Popen`` (which waits for the exec). Waiting
    for the child to be scheduled instead cost a loaded machine tens of ms per job.
    """
    try:
        pid = os.fork()
    except OSError as e:
        for fd in fds:
            os.close(fd)
        _send(sock, {"error": f"cannot fork: {e}"})
        return
    if pid == 0:
        _child(sock, wake[0], wake[1], request, fds, parent_pidfd)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass  # it has ended already (and its end is reported)
    for fd in fds:
        os.close(fd)
    children.add(pid)
    _send(sock, {"pid": pid})


def _leave_terminal() -> None:
    """Give up the controlling terminal of the parent's session, if there is one: the
    children forked afterwards have none. A job in a process group of its own that read
    from the terminal would be stopped (``SIGTTIN``); without one it gets an error."""
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:
        return  # no terminal (or a session of its own)
    try:
        import fcntl
        import termios

        fcntl.ioctl(fd, termios.TIOCNOTTY)
    except OSError:
        pass
    finally:
        os.close(fd)


def serve(sock: socket.socket, preload: Sequence[str], later_preload: Sequence[str] = ()) -> None:
    """The template's loop: fork a child per request, report each child's end; import
    ``later_preload`` once no request has come for :data:`LATER_IDLE_SECONDS`."""
    global _prctl
    _leave_terminal()
    _preload(preload)
    parent_pidfd = _open_parent_pidfd()
    import gc

    gc.freeze()  # the children's collections then leave the preloaded objects' pages shared
    _send(sock, {"ready": True})
    if parent_pidfd is not None:  # while the ready message travels and the first requests come
        import ctypes  # for the children's _die_with_template, looked up once here

        _prctl = ctypes.CDLL(None, use_errno=True).prctl
        gc.freeze()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent passes Ctrl-C on to its jobs
    buf = bytearray()
    fds: list[int] = []
    children: set[int] = set()
    watched = [sock.fileno(), wake_r] + ([parent_pidfd] if parent_pidfd is not None else [])
    later = list(later_preload)
    while True:
        ready = select.select(watched, [], [], LATER_IDLE_SECONDS if later else None)[0]
        if not ready:  # no request for a while: the program's first starts are past
            _preload(later)
            later.clear()
            gc.freeze()
            continue
        if parent_pidfd in ready:
            _kill_children(children)  # a job in a long C call cannot see it: it ends here
            return
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(sock, children)
        if sock.fileno() in ready:
            got = _recv_requests(sock, buf, fds)
            if got is None:
                return  # the backend is gone: the jobs end with their parent by themselves
            for request, its_fds in got:
                _fork_job(sock, request, its_fds, children, (wake_r, wake_w), parent_pidfd)


# -- the backend's side ---------------------------------------------------------------------------


class TemplateError(OSError):
    """The template could not be started or has gone: start the job the plain way."""


class Request:
    """What the template is sent for one job: its environment, working directory, the module
    whose ``main()`` it runs, its log's descriptor and its end of the channel (or None).

    (Not a ``typing.NamedTuple``: the template runs this module, and would import ``typing``
    for it.)
    """

    __slots__ = ("env", "cwd", "module", "logfd", "channel")

    def __init__(self, env: dict[str, str], cwd: str | None, module: str, logfd: int,
                 channel: int | None = None) -> None:
        self.env, self.cwd, self.module, self.logfd, self.channel = env, cwd, module, logfd, channel


class ForkedJob:
    """What the local backend holds of a forked job: the parts of ``Popen`` it uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()

    def set_end(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        assert self.returncode is not None
        return self.returncode


class Template:
    """A template process of this backend, started on first use."""

    def __init__(self, python: str, env: dict[str, str], preload: Sequence[str],
                 on_lost: Callable[[str], None]) -> None:
        import subprocess

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # The parent's session, a group of its own (see the module's docstring).
            group: dict[str, Any] = ({"process_group": 0} if sys.version_info >= (3, 11)
                                     else {"start_new_session": True})
            self._popen = subprocess.Popen(
                [python, "-m", "fiber_core.backends.template", str(theirs.fileno()), *preload],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=None,
                pass_fds=(theirs.fileno(),), **group)
        except OSError as e:
            ours.close()
            raise TemplateError(f"cannot start the template process: {e}") from e
        finally:
            theirs.close()
        self._sock = ours
        self._lock = threading.Lock()  # one request at a time
        self._answers: list[dict] = []
        self._answered = threading.Condition()
        self._jobs: dict[int, ForkedJob] = {}
        self._early: dict[int, int] = {}  # exits reported before the pid's answer was read
        self._gone: str | None = None
        self.on_lost = on_lost
        """Told why, when the template has gone with jobs of its own."""
        self.ready = threading.Event()
        """Set once the template has imported its modules and forks jobs."""
        self._settled = threading.Event()  # ready, or gone
        threading.Thread(target=self._read, daemon=True, name="fiber-template").start()

    def start(self, requests: Sequence[Request]) -> list[ForkedJob | TemplateError]:
        """Fork a job for each request, all sent before the first answer is read; each a
        job or the TemplateError that says why not (start that one the plain way then)."""
        with self._lock:
            sent = 0
            failed: TemplateError | None = None
            for r in requests:
                line = json.dumps({"env": r.env, "cwd": r.cwd, "module": r.module,
                                   "channel": r.channel is not None}).encode() + b"\n"
                fds = [r.logfd] if r.channel is None else [r.logfd, r.channel]
                if self._gone is not None:
                    failed = TemplateError(self._gone)
                    break
                try:
                    self._sock.sendmsg([line], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                 b"".join(fd.to_bytes(4, sys.byteorder) for fd in fds))])
                except OSError as e:
                    failed = TemplateError(f"the template process has gone: {e}")
                    break
                sent += 1
            out = [self._answer() for _ in range(sent)]
        return out + [failed or TemplateError("not sent")] * (len(requests) - sent)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the template forks jobs (True), has gone or ``timeout`` passed (False)."""
        self._settled.wait(timeout)
        return self.ready.is_set() and self._gone is None

    def _answer(self) -> ForkedJob | TemplateError:
        with self._answered:
            while not self._answers and self._gone is None:
                self._answered.wait()
            if not self._answers:
                return TemplateError(self._gone or "the template process has gone")
            answer = self._answers.pop(0)
            if "error" in answer:
                return TemplateError(answer["error"])
            job = ForkedJob(answer["pid"])
            if job.pid in self._early:
                job.set_end(self._early.pop(job.pid))
            else:
                self._jobs[job.pid] = job
            return job

    def _read(self) -> None:
        buf = b""
        why = "the template process has ended"
        try:
            while True:
                data = self._sock.recv(65536)
                if not data:
                    break
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    message = json.loads(line)
                    with self._answered:
                        if "ready" in message:
                            self.ready.set()
                            self._settled.set()
                        elif "exit" in message:
                            job = self._jobs.pop(message["exit"], None)
                            if job is None:
                                self._early[message["exit"]] = message["code"]
                            else:
                                job.set_end(message["code"])
                        else:
                            self._answers.append(message)
                            self._answered.notify_all()
        except (OSError, ValueError) as e:
            why = f"the template process failed: {e}"
        with self._answered:
            self._gone = why
            lost, self._jobs = self._jobs, {}
            self._answered.notify_all()
        self._settled.set()
        for job in lost.values():  # their end could not be known any more: they are stopped
            try:
                os.killpg(job.pid, signal.SIGKILL)
            except OSError:
                pass
            job.set_end(-signal.SIGKILL)
        if lost:
            self.on_lost(why)

    def close(self, timeout: float = 5.0) -> None:
        """End the template: it ends once it sees its socket closed, else after ``timeout``
        seconds it is killed (its jobs end with it: see the module's docstring)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self._popen.wait(timeout)
        except Exception:
            self._popen.kill()
            try:
                self._popen.wait(timeout or 5.0)
            except Exception:
                pass


if __name__ == "__main__":
    try:
        serve(socket.socket(fileno=int(sys.argv[1])), [*PRELOAD, *sys.argv[2:]], LATER)
    except (ConnectionError, KeyboardInterrupt):
        pass  # the backend went away meanwhile: nothing is left to serve
