"""Local jobs forked from a template process that has Fiber imported already.

A fresh interpreter spends most of a local job's start importing Fiber (about 50
ms of CPU each). The local backend instead starts, on first use, one *template*:
``python -m fiber_core.backends.template``, a clean process (never the parent's
state, as the stdlib's forkserver) that imports the worker's modules and then
forks one child per job. A child becomes the job exactly as if its command had
run: a session of its own, the job's environment and working directory, stdout
and stderr to the job's log, then the worker's ``main()``.

The template talks to the backend over a Unix socket pair (its descriptor number is
the template's first argument):

backend -> template
    one request per job: a JSON line ``{"env": {...}, "cwd": ..., "module": ...}``,
    with the log file's descriptor attached (``SCM_RIGHTS``).
template -> backend
    ``{"ready": true}`` once it has imported what it preloads; then ``{"pid": N}`` in answer to each request (``{"error": TEXT}`` if the fork
    failed), and ``{"exit": N, "code": C}`` when child N ended (C as
    :mod:`multiprocessing` has it: ``-9`` after SIGKILL).

The template ends when the socket closes (its parent ended or cleaned up). It
preloads the worker module, the Pool's module (a pool worker imports it first: about
6 ms of CPU each, as much as the rest of its start) and the modules named by the
``forkserver_preload`` setting (``fiber_core.set_forkserver_preload``).
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

from fiber_core.contract.env import ENV_PARENT_PID, ENV_PARENT_PIDFD

_MAX_LINE = 1 << 24


# -- the template process --------------------------------------------------------------------


def _child(sock: socket.socket, wake_r: int, wake_w: int, request: dict, logfd: int,
           parent_pidfd: int | None, ready_w: int) -> None:
    """In the forked child: become the job, run it, never return."""
    code = 1
    try:
        sock.close()
        os.close(wake_r)
        os.close(wake_w)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
        os.setsid()
        os.write(ready_w, b"x")  # its process group exists: a signal to it reaches the job now
        os.close(ready_w)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(logfd, 1)
        os.dup2(logfd, 2)
        for fd in (devnull, logfd):
            if fd > 2:
                os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        util = sys.modules.get("multiprocessing.util")
        if util is not None:  # as for the stdlib's fork children: the template's exit work is not theirs
            util._finalizer_registry.clear()  # type: ignore[attr-defined]  # noqa: SLF001 - a forked child drops the template's exit work, as the stdlib's fork children do
            util.process.current_process()._config.pop("tempdir", None)  # type: ignore[attr-defined]  # noqa: SLF001 - a forked child drops the template's exit work, as the stdlib's fork children do
        if parent_pidfd is not None:
            os.environ[ENV_PARENT_PIDFD] = str(parent_pidfd)
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


def _recv_request(sock: socket.socket, buf: bytearray) -> tuple[dict, int] | None:
    """One request and its descriptor; None at end of stream."""
    fds: list[int] = []
    while b"\n" not in buf:
        data, ancdata, _, _ = sock.recvmsg(65536, socket.CMSG_SPACE(4 * 4))
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += [int.from_bytes(payload[i:i + 4], sys.byteorder) for i in range(0, len(payload) - 3, 4)]
        if not data:
            for fd in fds:
                os.close(fd)
            return None
        buf += data
        if len(buf) > _MAX_LINE:
            raise ValueError("request too long")
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"a request carries {len(fds)} descriptors, not 1")
    return json.loads(line), fds[0]


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
    """A pidfd of the parent of the run, which the children watch; None where there is none."""
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


def _fork_job(sock: socket.socket, request: dict, logfd: int, children: set[int],
              wake: tuple[int, int], parent_pidfd: int | None) -> None:
    """Fork the child for one request and answer with its pid once it leads its own group."""
    ready_r, ready_w = os.pipe()
    try:
        pid = os.fork()
    except OSError as e:
        for fd in (logfd, ready_r, ready_w):
            os.close(fd)
        _send(sock, {"error": f"cannot fork: {e}"})
        return
    if pid == 0:
        os.close(ready_r)
        _child(sock, wake[0], wake[1], request, logfd, parent_pidfd, ready_w)
    os.close(logfd)
    os.close(ready_w)
    children.add(pid)
    while True:  # answer once the child leads its own group (as Popen returns after exec)
        try:
            os.read(ready_r, 1)
            break
        except InterruptedError:
            continue
    os.close(ready_r)
    _send(sock, {"pid": pid})


def serve(sock: socket.socket, preload: Sequence[str]) -> None:
    """The template's loop: fork a child per request, report each child's end."""
    _preload(preload)
    parent_pidfd = _open_parent_pidfd()
    import gc

    gc.freeze()  # the children's collections then leave the preloaded objects' pages shared
    _send(sock, {"ready": True})
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent passes Ctrl-C on to its jobs
    buf = bytearray()
    children: set[int] = set()
    while True:
        ready = select.select([sock.fileno(), wake_r], [], [])[0]
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(sock, children)
        if sock.fileno() in ready:
            got = _recv_request(sock, buf)
            if got is None:
                return  # the backend is gone: the jobs end with their parent by themselves
            _fork_job(sock, got[0], got[1], children, (wake_r, wake_w), parent_pidfd)


# -- the backend's side ---------------------------------------------------------------------------


class TemplateError(OSError):
    """The template could not be started or has gone: start the job the plain way."""


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
            self._popen = subprocess.Popen(
                [python, "-m", "fiber_core.backends.template", str(theirs.fileno()), *preload],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=None,
                start_new_session=True, pass_fds=(theirs.fileno(),))
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
        self._on_lost = on_lost
        self.ready = threading.Event()
        """Set once the template has imported its modules: until then jobs start the plain way."""
        threading.Thread(target=self._read, daemon=True, name="fiber-template").start()

    def start(self, env: dict[str, str], cwd: str | None, module: str, logfd: int) -> ForkedJob:
        """Fork a job; TemplateError if the template cannot (start it the plain way then)."""
        request = json.dumps({"env": env, "cwd": cwd, "module": module}).encode() + b"\n"
        with self._lock:
            if self._gone is not None:
                raise TemplateError(self._gone)
            try:
                self._sock.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                logfd.to_bytes(4, sys.byteorder))])
            except OSError as e:
                raise TemplateError(f"the template process has gone: {e}") from e
            with self._answered:
                while not self._answers and self._gone is None:
                    self._answered.wait()
                if not self._answers:
                    raise TemplateError(self._gone or "the template process has gone")
                answer = self._answers.pop(0)
                if "error" in answer:
                    raise TemplateError(answer["error"])
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
        for job in lost.values():  # their end could not be known any more: they are stopped
            try:
                os.killpg(job.pid, signal.SIGKILL)
            except OSError:
                pass
            job.set_end(-signal.SIGKILL)
        if lost:
            self._on_lost(why)

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self._popen.wait(5)
        except Exception:
            self._popen.kill()


if __name__ == "__main__":
    try:
        serve(socket.socket(fileno=int(sys.argv[1])),
              ["fiber_core.processes.worker", "fiber_core.parallel.pool.worker", *sys.argv[2:]])
    except (ConnectionError, KeyboardInterrupt):
        pass  # the backend went away meanwhile: nothing is left to serve
