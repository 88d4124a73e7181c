"""Pure: what the live view remembers of a pool: throughput over time, each worker's timeline, the losses.

Everything here is bounded whatever the run's length and size: a pool of 512 workers that
does a million tasks keeps the same few hundred kilobytes as one of 3 workers that did
ten. Nothing reads a clock: the master passes ``at`` (``time.monotonic()``) in, and a
view is given ``now``; the times it returns are seconds before ``now``.
"""

from __future__ import annotations

import collections
from typing import Any

FINE_SECONDS = 600
"""Throughput is kept per second for this many seconds (the last 10 minutes) ..."""

COARSE_SECONDS = 60
"""... and per minute before that ..."""

COARSE_BUCKETS = 24 * 60
"""... for this many minutes (a day); older than that, it is forgotten."""

EVENTS_PER_WORKER = 24
"""State changes kept per worker (its last ones; busy and idle are sampled once a second,
so a worker that switches faster shows as busy)."""

ENDED_WORKERS = 64
"""Ended workers (lost, retired, replaced) whose timeline is kept, the last ones; the live
ones are all kept (a pool's size bounds them)."""

LOSSES_KEPT = 64
"""Losses kept with their reasons and the lost worker's last lines (the last ones)."""

LOSS_LINES = 20
"""Lines of a lost worker's output kept with its loss."""

SNAPSHOT_OUTPUT_LINES = 2048
"""Lines of output a snapshot carries for all live workers together: each worker's last
:func:`output_lines_per_worker` lines (at most 300 characters each), so that the page's
JSON stays under a megabyte for 512 workers."""

MIN_OUTPUT_LINES = 3
"""... but never fewer than this per worker."""


def output_lines_per_worker(workers: int, most: int = 50) -> int:
    """How many of its last lines a snapshot shows for each of ``workers`` live workers."""
    if workers <= 0:
        return most
    return max(MIN_OUTPUT_LINES, min(most, SNAPSHOT_OUTPUT_LINES // workers))


class Throughput:
    """Tasks done over time: per second for :data:`FINE_SECONDS`, per minute before."""

    __slots__ = ("_fine", "_coarse")

    def __init__(self) -> None:
        self._fine: collections.deque[list[int]] = collections.deque()  # [second, tasks]
        self._coarse: collections.deque[list[int]] = collections.deque(maxlen=COARSE_BUCKETS)  # [minute, tasks]

    def add(self, at: float, tasks: int) -> None:
        """``tasks`` were done at ``at`` (a few operations: the master thread calls it per
        batch, without the pool's lock)."""
        second = int(at)
        fine = self._fine
        if fine and fine[-1][0] == second:
            fine[-1][1] += tasks
            return
        fine.append([second, tasks])
        while fine[0][0] <= second - FINE_SECONDS:
            old, n = fine.popleft()
            minute = old - old % COARSE_SECONDS
            coarse = self._coarse
            if coarse and coarse[-1][0] == minute:
                coarse[-1][1] += n
            else:
                coarse.append([minute, n])

    def rate(self, now: float, seconds: float, since: float) -> float:
        """Tasks per second over the last ``seconds`` (or since ``since``, if later)."""
        start = max(since, now - seconds)
        span = now - start
        if span <= 0:
            return 0.0
        first = int(start)
        recent = 0
        for second, n in reversed(list(self._fine)):  # (a copy: see series)
            if second < first:
                break
            recent += n
        return recent / span

    def series(self, now: float) -> list[list[float]]:
        """``[seconds ago, tasks per second, span in seconds]`` for each second (or minute,
        before the last :data:`FINE_SECONDS`) in which tasks were done, the oldest first.
        Seconds without tasks are left out: they are zeros."""
        # Copies, each made at once: a snapshot taken while the master thread is stuck
        # (status_snapshot's fallback) reads while that thread may add.
        coarse, fine = list(self._coarse), list(self._fine)
        points = [[round(now - minute, 1), round(n / COARSE_SECONDS, 3), COARSE_SECONDS]
                  for minute, n in coarse]
        points += [[round(now - second, 1), n, 1] for second, n in fine]
        return points


def _aged(record: dict[str, Any], now: float) -> dict[str, Any]:
    """``record`` with its time ``at`` as ``ago``, seconds before ``now``."""
    return {**{k: v for k, v in record.items() if k != "at"}, "ago": round(now - record["at"], 1)}


class _Track:
    """One worker's timeline: who it is, its state changes, its end."""

    __slots__ = ("name", "job_id", "host", "started", "events", "end")

    def __init__(self, at: float, name: str, job_id: str | None, host: str | None) -> None:
        self.name, self.job_id, self.host, self.started = name, job_id, host, at
        self.events: collections.deque[tuple[float, str]] = collections.deque(maxlen=EVENTS_PER_WORKER)
        self.end: dict[str, Any] | None = None

    def view(self, now: float) -> dict[str, Any]:
        return {"name": self.name, "id": self.job_id, "host": self.host,
                "started_ago": round(now - self.started, 1),
                "events": [[round(now - at, 1), state] for at, state in self.events],
                "end": None if self.end is None else _aged(self.end, now)}


class Timeline:
    """Each worker's life as the live view shows it (started, its states, its end) and the
    losses with their reasons and the lost worker's last lines."""

    def __init__(self) -> None:
        self._live: dict[int, _Track] = {}
        self._ended: collections.deque[_Track] = collections.deque(maxlen=ENDED_WORKERS)
        self._losses: collections.deque[dict[str, Any]] = collections.deque(maxlen=LOSSES_KEPT)

    def _track(self, at: float, key: int, name: str, job_id: str | None, host: str | None) -> _Track:
        track = self._live.get(key)
        if track is None:
            track = self._live[key] = _Track(at, name, job_id, host)
        else:  # a job's id and host are known once it started
            track.job_id, track.host = job_id or track.job_id, host or track.host
        return track

    def observe(self, at: float, key: int, name: str, job_id: str | None, host: str | None,
                state: str) -> None:
        """Worker ``key`` is in ``state`` at ``at``: a change is kept, a repeat is not."""
        track = self._track(at, key, name, job_id, host)
        if not track.events or track.events[-1][1] != state:
            track.events.append((at, state))

    def ended(self, at: float, key: int, name: str, job_id: str | None, host: str | None, *,
              reason: str, description: str, lost: bool, lines: list[str]) -> None:
        """Worker ``key`` ended: ``reason`` (an end reason's value, or ``retired``),
        ``description`` for people, ``lost`` if the pool counts it as a loss; ``lines``:
        the last it printed."""
        track = self._track(at, key, name, job_id, host)
        del self._live[key]
        track.end = {"at": at, "reason": reason, "description": description, "lost": lost}
        if track.events and track.events[-1][1] == "lost":
            track.events.pop()  # sampled as lost a moment ago: its end says when
        track.events.append((at, "lost" if lost else "ended"))
        self._ended.append(track)
        if lost:
            self._losses.append({"at": at, "worker": name, "id": track.job_id, "host": track.host,
                                 "reason": reason, "description": description,
                                 "output": lines[-LOSS_LINES:]})

    def view(self, now: float) -> dict[str, Any]:
        """The timelines (live workers first, in the order they started, then the ended
        ones, the last to end first) and the losses, the last first."""
        live = sorted(self._live.values(), key=lambda t: t.started)
        return {"timeline": [t.view(now) for t in live] + [t.view(now) for t in reversed(self._ended)],
                "loss_log": [_aged(loss, now) for loss in reversed(self._losses)]}
