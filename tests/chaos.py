"""Fires a :class:`~fiber_core.testing.faults.FaultSchedule` into a running Pool (no pytest:
a thread of the test, reading the pool's progress).

A fault strikes once the pool has delivered ``after`` results (its own count, read every
few milliseconds), on the worker at ``worker`` modulo the candidates the test names (in the
order of their worker numbers). The points are the run's own, so a seed replays the same
faults at the same points; which process a point finds running may still differ by a
replacement's start.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

from fiber_core.testing.faults import FaultSchedule

SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}
"""What each kind of fault sends."""

POLL_SECONDS = 0.002
"""How often the pool's count of results is read."""


def serving(pool: object) -> Callable[[], list[int]]:
    """The pids of a pool's workers that are not lost (starting ones too), by worker number."""
    def pids() -> list[int]:
        with pool._lock:  # type: ignore[attr-defined]
            return [w.process.pid for _, w in sorted(pool._workers.items())  # type: ignore[attr-defined]
                    if not w.lost and w.process.pid is not None]
    return pids


def connected(pool: object) -> Callable[[], list[int]]:
    """The pids of a pool's workers that have connected and are not lost, by worker number."""
    def pids() -> list[int]:
        with pool._lock:  # type: ignore[attr-defined]
            return [w.process.pid for _, w in sorted(pool._workers.items())  # type: ignore[attr-defined]
                    if not w.lost and w.conn is not None and w.process.pid is not None]
    return pids


class Chaos:
    """Strikes as the schedule says while the pool runs: ``with Chaos(pool, schedule):``."""

    def __init__(self, pool: object, schedule: FaultSchedule,
                 candidates: Callable[[], list[int]] | None = None) -> None:
        self.pool, self.schedule = pool, schedule
        self.candidates = candidates or serving(pool)
        self.struck: list[tuple[int, str, int]] = []  # (after, kind, pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="chaos")

    def __enter__(self) -> Chaos:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while self.schedule.left and not self._stop.wait(POLL_SECONDS):
            done = self.pool._tasks_done  # type: ignore[attr-defined]
            for fault in self.schedule.due(done):
                pids = self.candidates()
                if not pids:
                    continue
                pid = pids[fault.worker % len(pids)]
                try:
                    os.kill(pid, SIGNALS[fault.kind])
                except ProcessLookupError:
                    continue
                self.struck.append((fault.after, fault.kind, pid))

    def __repr__(self) -> str:
        return f"Chaos(seed={self.schedule.seed}, struck {len(self.struck)})"
