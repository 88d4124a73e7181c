"""The job-state machinery every backend shares: why a job ended, its record, its log, watchers.

A backend does not keep its own table of exit codes, done events or log buffers:
each :class:`~fiber_core.contract.backend.Job` carries a :class:`JobState`, and
the backend *finishes* it when the platform says the job ended::

    job.state.finish(137, EndReason.OOM, "container memory limit 2048 MiB")

The first finish wins, so a watcher thread, a poll and a terminate racing to
record the same end never disagree. :meth:`Backend.poll_job
<fiber_core.contract.backend.Backend.poll_job>`, :meth:`~fiber_core.contract.backend.Backend.wait_for_job`
and :meth:`~fiber_core.contract.backend.Backend.get_job_logs` read the record by
default. A :class:`Watcher` is the thread that keeps records fresh (an event
stream, a batched status query), restarted with a backoff when it fails.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable

from fiber_core.base.log import log

LOG_LIMIT = 1 << 20
"""Bytes of a job's output a :class:`JobState` keeps by default (the last ones)."""

HOST_LOST_EXITCODE = -1
"""The exit code of a job whose machine, or the way to it, was lost before it reported one
(with :attr:`EndReason.HOST_LOST`): ``-SIGHUP``, the line to it hung up. Every backend uses it."""


class EndReason(enum.Enum):
    """Why a job ended, as far as its backend can tell.

    Fiber uses it to tell an application's failure from an infrastructure loss:
    a job lost to :attr:`PREEMPTED`, :attr:`HOST_LOST` or :attr:`STOPPED` is not
    its task's fault; :attr:`OOM` and :attr:`EXITED` (which includes a signal
    nobody in Fiber sent) may be. :attr:`KILLED` is a SIGKILL that the platform
    says was not an out-of-memory kill: most likely from outside (an operator, a
    node agent, a chaos test), though the program may have sent it itself.
    """

    EXITED = "exited"
    """The program ended by itself: its own exit code, or a signal Fiber did not send."""
    STOPPED = "stopped"
    """Stopped by Fiber: :meth:`~fiber_core.contract.backend.Backend.terminate_job`,
    :meth:`~fiber_core.contract.backend.Backend.kill_job` or cleanup."""
    OOM = "oom"
    """Killed by the system for using more memory than it may."""
    KILLED = "killed"
    """Killed by SIGKILL that Fiber did not send, and the platform says it was not an
    out-of-memory kill (the kernel's count of OOM kills did not move, Docker's and
    Kubernetes' ``OOMKilled`` is false). Where the platform cannot tell, the end is
    :attr:`EXITED`."""
    PREEMPTED = "preempted"
    """Preempted or evicted: a spot instance reclaimed, a pod evicted or disrupted, a node drained."""
    HOST_LOST = "host-lost"
    """The machine it ran on, or the way to reach it, was lost."""
    NEVER_STARTED = "never-started"
    """The platform could not start it: a missing image, unschedulable, refused."""
    UNRESPONSIVE = "unresponsive"
    """Alive as far as its platform and the network can tell, but silent: a pool worker that
    sent nothing (no heartbeat) for ``heartbeat_timeout`` seconds, which Fiber then stopped.
    Frozen (SIGSTOP, a hung read of a network file system, a stuck driver) or holding the
    GIL in a C extension past the bound. Set by the Pool, never by a backend."""

    @property
    def infrastructure(self) -> bool:
        """True when the end says nothing about the job's own program."""
        return self in (EndReason.STOPPED, EndReason.PREEMPTED, EndReason.HOST_LOST)


class LogRing:
    """The last ``limit`` bytes a job wrote (stdout and stderr, as they arrive)."""

    def __init__(self, limit: int = LOG_LIMIT) -> None:
        self.limit = limit
        self._buf = bytearray()
        self._lock = threading.Lock()

    def append(self, data: bytes | str) -> None:
        """Add output; the oldest bytes go once more than ``limit`` are kept."""
        if isinstance(data, str):
            data = data.encode("utf-8", "replace")
        with self._lock:
            self._buf += data
            excess = len(self._buf) - self.limit
            if excess > 0:
                del self._buf[:excess]

    def text(self) -> str:
        """What is kept, decoded as UTF-8 (bad bytes replaced)."""
        with self._lock:
            return self._buf.decode("utf-8", "replace")

    def __len__(self) -> int:
        return len(self._buf)


class JobState:
    """The record of one job's life: exit code, why it ended, a done event, its log.

    Like :class:`concurrent.futures.Future`: :meth:`finish` sets the result once
    (the first call wins and returns ``True``; later ones change nothing and
    return ``False``), :meth:`wait` blocks until then. Thread-safe.
    """

    def __init__(self, log_limit: int = LOG_LIMIT) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.exitcode: int | None = None
        """``None`` while the job runs; its exit code after (``-N`` for signal ``N``)."""
        self.reason: EndReason | None = None
        """Why it ended (``None`` while it runs)."""
        self.detail = ""
        """What the platform said about the end, for people ("OOMKilled", "Host EC2 terminated")."""
        self.stop_requested = False
        """Fiber asked the job to stop: an end by signal is then :attr:`EndReason.STOPPED`."""
        self.log = LogRing(log_limit)
        self._callbacks: list[Callable[[JobState], None]] = []

    def add_done_callback(self, fn: Callable[[JobState], None]) -> None:
        """Call ``fn(self)`` once the job ends: at once if it has, else from :meth:`finish`.

        Like :meth:`concurrent.futures.Future.add_done_callback`: an exception ``fn`` raises
        is logged and ignored. It runs in the thread that finishes the job: keep it short.
        """
        with self._lock:
            if self.exitcode is None:
                self._callbacks.append(fn)
                return
        self._call(fn)

    def _call(self, fn: Callable[[JobState], None]) -> None:
        try:
            fn(self)
        except Exception:
            log.exception("fiber: a job's done callback failed")

    def finish(self, exitcode: int, reason: EndReason | None = None, detail: str = "") -> bool:
        """Record the end of the job; return whether this call was the first.

        Without ``reason``: :attr:`EndReason.STOPPED` if Fiber asked the job to
        stop and it ended by a signal, else :attr:`EndReason.EXITED`.
        """
        with self._lock:
            if self.exitcode is not None:
                return False
            if reason is None:
                stopped = self.stop_requested and exitcode < 0
                reason = EndReason.STOPPED if stopped else EndReason.EXITED
            self.exitcode, self.reason, self.detail = exitcode, reason, detail
            callbacks, self._callbacks = self._callbacks, []
        self._done.set()
        for fn in callbacks:
            self._call(fn)
        return True

    def done(self) -> bool:
        """Whether the job has ended."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job ends or ``timeout`` seconds pass; return :meth:`done`."""
        return self._done.wait(timeout)

    def __repr__(self) -> str:
        if self.exitcode is None:
            return "<JobState running>"
        return f"<JobState exitcode={self.exitcode} reason={self.reason.value if self.reason else None}>"


class Watcher:
    """A daemon thread that calls ``step()`` until stopped, backing off when it fails.

    ``step`` does one round of watching (read an event stream until it breaks, run
    one batched status query) and returns the seconds to wait before the next
    round, or ``None`` for ``interval``. An exception is logged (debug) and the
    next round comes after a backoff that doubles from ``interval`` up to
    ``max_backoff``; a round that succeeds resets it. :meth:`wake` starts the next
    round at once; :meth:`stop` ends the thread after the current round.
    Create one with :meth:`Backend.watch <fiber_core.contract.backend.Backend.watch>`,
    which also stops it at cleanup.
    """

    def __init__(self, step: Callable[[], float | None], name: str, interval: float = 1.0,
                 max_backoff: float = 30.0) -> None:
        self._step = step
        self.interval = interval
        self.max_backoff = max_backoff
        self._stopped = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def wake(self) -> None:
        """Run the next round now instead of after the current wait."""
        self._wake.set()

    def stop(self) -> None:
        """End the thread after the current round (it is not joined)."""
        self._stopped.set()
        self._wake.set()

    def _run(self) -> None:
        backoff = self.interval
        while not self._stopped.is_set():
            try:
                pause = self._step()
                backoff = self.interval
            except Exception as e:
                if self._stopped.is_set():
                    return
                log.debug("fiber: %s failed, again in %.1f s: %s", self._thread.name, backoff, e)
                pause, backoff = backoff, min(backoff * 2, self.max_backoff)
            self._wake.wait(self.interval if pause is None else pause)
            self._wake.clear()


__all__ = ["HOST_LOST_EXITCODE", "LOG_LIMIT", "EndReason", "JobState", "LogRing", "Watcher"]
