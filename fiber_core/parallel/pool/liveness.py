"""Whether a pool worker still answers, and what it uses: heartbeats, decided without I/O.

A worker sends ``POOL_HEARTBEAT`` every :func:`heartbeat_interval` seconds from a thread
of its own (:mod:`~fiber_core.parallel.pool.worker`), with a sample of its use
(:mod:`fiber_core.base.usage`). The master counts a worker that has sent nothing for
``heartbeat_timeout`` seconds as lost (:func:`silent`): TCP keepalive cannot see that, since
the kernel answers it for a process that is stopped. Pure: the master gives the times.
"""

from __future__ import annotations

import collections
from typing import Any

USAGE_HISTORY = 60
"""Samples of a worker's use the master keeps for the live view (the last ones)."""

HEARTBEATS_PER_TIMEOUT = 5
"""Heartbeats a worker sends within one ``heartbeat_timeout``: it is lost only after missing
this many in a row, so a late one (a busy master, a slow link) is no loss."""

MIN_INTERVAL = 0.05
MAX_INTERVAL = 5.0
"""The heartbeat interval's bounds, in seconds: a small bound (a test's) sends no flood, a
big one still refreshes the live view's samples every few seconds."""


def heartbeat_interval(timeout: float) -> float:
    """Seconds between a worker's heartbeats for a ``heartbeat_timeout`` of ``timeout``
    (0: none are sent)."""
    if timeout <= 0:
        return 0.0
    return min(MAX_INTERVAL, max(MIN_INTERVAL, timeout / HEARTBEATS_PER_TIMEOUT))


def check_interval(timeout: float) -> float:
    """How often the master looks for silent workers: once per heartbeat interval, so a
    frozen worker is found within ``timeout`` plus one interval."""
    return heartbeat_interval(timeout)


def silent(heard: float, now: float, timeout: float) -> bool:
    """Whether a worker last heard from at ``heard`` counts as lost at ``now``."""
    return timeout > 0 and now - heard > timeout


class UsageLog:
    """A worker's latest sample of use and the last :data:`USAGE_HISTORY` of them."""

    __slots__ = ("latest", "history")

    def __init__(self) -> None:
        self.latest: dict[str, Any] | None = None
        self.history: collections.deque[tuple[float, float, int | None]] = collections.deque(
            maxlen=USAGE_HISTORY)

    def add(self, now: float, sample: dict[str, Any]) -> None:
        """Keep ``sample``, taken at (monotonic) ``now``."""
        self.latest = sample
        self.history.append((now, sample["cpu"], sample["rss"]))

    def view(self, now: float) -> dict[str, Any]:
        """The live view's keys: ``usage`` (the latest sample, or None) and ``usage_history``
        (``[seconds_ago, cpu, rss]``, oldest first)."""
        return {"usage": self.latest,
                "usage_history": [[round(now - at, 3), cpu, rss] for at, cpu, rss in self.history]}
