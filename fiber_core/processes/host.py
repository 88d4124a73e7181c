"""This program as a process among its jobs, apart from any one child it starts.

Its own process objects (the main process, and a job's parent), and what it does
for its children as a whole: it prints their output (each line prefixed with the
job's name), forwards SIGINT to the running children, ends them at exit, and tells
a job's prelude how to import this program's main module and set up Fiber's logger.

Ctrl-C. A terminal's SIGINT reaches only this process (jobs run in their own
session, or on other machines). So that they get it as the stdlib's children
would, the first ``start()`` from the main thread chains a SIGINT handler in
front of the program's: it sends ``interrupt`` to every running child, which
raises SIGINT in itself (and forwards it to its own children), then calls the
handler that was there (by default: ``KeyboardInterrupt`` here). A handler the
program installs later replaces it, and then the program decides.
"""

from __future__ import annotations

import collections
import os
import signal
import sys
import threading

from fiber_core.base.log import LOGGER_NAME
from fiber_core.base.text import printable
from fiber_core.runtime.run import runtime
from fiber_core.wire.messages import PROCESS_STDERR, PROCESS_STDOUT

TYPE_CHECKING = False  # typing's own, without importing typing: a job starts without it
if TYPE_CHECKING:
    from typing import Any

    from fiber_core.wire.framing import Connection


class BaseProcess:
    """What the main process and every started process have in common."""

    _identity: tuple[int, ...] = ()
    _name = "MainProcess"
    _daemon = False

    @property
    def name(self) -> str:
        return self._name

    @name.setter
    def name(self, value: str) -> None:
        if not isinstance(value, str):
            raise TypeError("name must be a string")
        self._name = value

    @property
    def daemon(self) -> bool:
        return self._daemon

    @daemon.setter
    def daemon(self, value: bool) -> None:
        self._daemon = bool(value)

    @property
    def ident(self) -> int | str | None:
        return self.pid

    @property
    def pid(self) -> int | str | None:  # overridden
        return os.getpid()

    @property
    def authkey(self) -> bytes:
        return runtime().authkey

    @property
    def exitcode(self) -> int | None:
        """``None``: the caller's own process, or its parent, is running."""
        return None

    @property
    def resources(self) -> dict[str, Any]:
        """What this process got: GPU type and count, capacity kind, host, cost per hour
        (``fiber_core.contract.placement.RESOURCE_KEYS``), as its backend said in its job's
        environment. The same keys on every backend; ``None`` where a value is unknown."""
        from fiber_core.contract.placement import job_resources  # on first use: most jobs never ask

        return job_resources()


class _MainProcess(BaseProcess):
    def is_alive(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<_MainProcess name={self._name!r} parent=None started>"


class _ParentProcess(BaseProcess):
    """What ``parent_process()`` returns inside a job."""

    def __init__(self, name: str, pid: int | None, conn: Connection | None) -> None:
        self._name = name
        self._pid = pid
        self._conn = conn
        self.gone = threading.Event()

    @property
    def pid(self) -> int | None:
        return self._pid

    def is_alive(self) -> bool:
        return not self.gone.is_set()

    def join(self, timeout: float | None = None) -> None:
        self.gone.wait(timeout)

    def __repr__(self) -> str:
        return f"<_ParentProcess name={self._name!r} parent=None {'started' if self.is_alive() else 'stopped'}>"


def flush_std_streams() -> None:
    """Flush stdout and stderr if the program left them usable (it may have closed or removed them)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, ValueError):
            pass


output_pumps: list[Any] = []
"""In a job that forwards its output: what copies fds 1 and 2 to the parent (each with a
``drain()`` that sends what is left), set by the job's bootstrap."""


def output_sent() -> None:
    """In a job: send the parent now what it wrote to stdout and stderr and was not sent
    yet (a pool worker does before it sends results, so that their output comes first)."""
    flush_std_streams()
    for pump in output_pumps:
        pump.drain()


OUTPUT_TAIL_LINES = 50
"""Lines of a job's output the parent keeps for the live view (its last ones)..."""

OUTPUT_LINE_CHARS = 300
"""... each cut to this many characters."""

_PRINTING = threading.Lock()
"""Held while a job's lines are written: the jobs' threads share ``sys.stdout``, whose
writes from several threads at once may interleave within a line."""


class _OutputPrinter:
    """Prints a job's output in the parent, each line prefixed with the job's name, and
    keeps its last :data:`OUTPUT_TAIL_LINES` lines (both streams, as they came)."""

    def __init__(self, name: str) -> None:
        self.prefix = f"[{name}] "
        self.partial: dict[bytes, bytes] = {PROCESS_STDOUT: b"", PROCESS_STDERR: b""}
        self.last: collections.deque[str] = collections.deque(maxlen=OUTPUT_TAIL_LINES)

    def write(self, kind: bytes, data: bytes | memoryview) -> None:
        data = self.partial[kind] + data
        lines = data.split(b"\n")
        self.partial[kind] = lines.pop()
        if lines:
            self._emit(kind, lines)

    def flush(self) -> None:
        for kind, rest in self.partial.items():
            if rest:
                self._emit(kind, [rest])
                self.partial[kind] = b""

    def tail(self, lines: int = OUTPUT_TAIL_LINES) -> list[str]:
        """The last ``lines`` lines printed (at most :data:`OUTPUT_TAIL_LINES`), escape
        sequences and control characters removed, each at most :data:`OUTPUT_LINE_CHARS`
        characters."""
        kept = list(self.last)  # (a copy: the monitor thread may append meanwhile)
        return [printable(line, "") for line in kept[max(0, len(kept) - lines):]] if lines > 0 else []

    def _emit(self, kind: bytes, lines: list[bytes]) -> None:
        stream = sys.stdout if kind == PROCESS_STDOUT else sys.stderr
        decoded = [line.decode("utf-8", "replace") for line in lines]
        self.last.extend(line[:OUTPUT_LINE_CHARS] for line in decoded[-OUTPUT_TAIL_LINES:])
        text = "".join(self.prefix + line + "\n" for line in decoded)
        try:
            with _PRINTING:
                stream.write(text)
                stream.flush()
        except (OSError, ValueError):
            pass


def _close_fds(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _main_reference() -> tuple[str, str] | None:
    """How a job can import this program's main module, as multiprocessing's spawn does."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name:
        return None if name == "__main__" or name.endswith(".__main__") else ("name", name)
    path = getattr(main, "__file__", None)
    return ("path", os.path.abspath(path)) if path else None


def _exit_children() -> None:
    """At exit, as multiprocessing does: run the finalizers of priority 0 and above (a
    manager not shut down is shut down, so its server job ends), terminate daemonic
    children, join the others.

    After SIGTERM every child is terminated: the program is being stopped.
    """
    # Only if loaded: whatever registers a finalizer imports it (a job may end without it).
    util = sys.modules.get("multiprocessing.util")
    run_finalizers = getattr(util, "_run_finalizers", None)
    if run_finalizers is not None:
        run_finalizers(0)
    rt = runtime()
    children = list(rt.children)
    for p in children:
        if (p.daemon or rt.terminating) and p.is_alive():
            p.terminate()
    for p in children:
        if p.joinable():
            p.join()


def _log_settings() -> tuple[int, bool] | None:
    """Fiber's logger level and stderr handler, for a job (as spawn passes the stdlib's).

    ``None`` when there is nothing to pass: a job then does not import logging.
    """
    logging = sys.modules.get("logging")
    if logging is None or LOGGER_NAME not in logging.Logger.manager.loggerDict:
        return None
    logger = logging.getLogger(LOGGER_NAME)
    to_stderr = any(getattr(h, "_fiber_stderr", False) for h in logger.handlers)
    level = logger.getEffectiveLevel()
    if level == logging.WARNING and not to_stderr:
        return None  # what a job has anyway
    return level, to_stderr


_sigint_chained = False


def _forward_sigint() -> None:
    """Chain, once, a SIGINT handler that passes the signal on to the running children.

    Only from the main thread (where Python runs signal handlers), and not when the
    program ignores SIGINT (its children would too).
    """
    global _sigint_chained
    if _sigint_chained or threading.current_thread() is not threading.main_thread():
        return
    _sigint_chained = True
    previous = signal.getsignal(signal.SIGINT)
    if previous in (signal.SIG_IGN, None):
        return

    def on_sigint(signum: int, frame: Any) -> None:
        children = [p._run for p in list(runtime().children) if p._run is not None]  # noqa: SLF001 - the SIGINT handler needs the run's non-blocking interrupt, which Process does not offer
        left = [run for run in children if not run.interrupt(wait=False)]
        if left:  # those that would block: not in the handler
            threading.Thread(target=lambda: [run.interrupt() for run in left], daemon=True,
                             name="fiber-sigint").start()
        if callable(previous):
            previous(signum, frame)
        else:  # SIG_DFL: end as the signal would have
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.raise_signal(signal.SIGINT)

    signal.signal(signal.SIGINT, on_sigint)


def cpu_count() -> int:
    """CPUs available to this process (the backend's cluster size is not known up front)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
