"""The Pool's batch planner: how a call is cut into units, and how many units go in one message.

Pure: it takes measured times and counts and returns sizes; no sockets, no clock.

Units
-----
A *unit* is ``chunksize`` consecutive items (``chunksize`` never changes results,
only how work is grouped). When ``map``/``starmap`` get no ``chunksize``, the input
is cut into :func:`auto_units` units of equal size, give or take one item
(:func:`unit_bounds`). ``imap`` and ``imap_unordered`` default to one item, as in
the stdlib.

Batches
-------
The master sends a worker as many units per message as fit in
:data:`TARGET_BATCH_SECONDS` of measured work (:data:`MAP_BATCH_SECONDS` for a
``map``), at least one, at most :data:`MAX_BATCH_UNITS`, and no more than half a
fair share of what is queued, unless that is less than :data:`MIN_SPLIT_SECONDS` of
work: then up to a full fair share (:func:`batch_size`). Until a call's first batch
is back, the same function's time per item in an earlier call stands in
(:func:`estimate`), or else its messages carry one unit.

Every ready worker gets a message before any gets a second. A second message in
flight (a prefetch) needs a known time, and is sent for a ``map`` while the queue
holds two units per worker, otherwise only while batches are shorter than
:data:`PREFETCH_BELOW_SECONDS` (:func:`prefetch_wanted`), and never with more than
:data:`PREFETCH_MAX_BYTES`: a worker reads its socket between batches only, so a
prefetch waits in the socket buffer. It never goes behind a batch that may run long
(:func:`runs_long`): :data:`PREFETCH_BELOW_SECONDS`, or for a ``map``
:data:`MAP_PREFETCH_BELOW_SECONDS`.
"""

from __future__ import annotations

TARGET_BATCH_SECONDS = 0.02
"""Work per message for calls whose results are seen as they come (``imap``, ``apply_async``):
short enough that results flow, long enough that a message's ~50 us cost is lost in it."""

MAP_BATCH_SECONDS = 0.25
"""Work per message for ``map``/``starmap``, whose results are only seen at the end: fewer,
bigger messages."""

MAX_BATCH_UNITS = 1000
"""Units in one message at most, however tiny: bounds a message's size and a lost batch."""

PREFETCH_BELOW_SECONDS = 0.05
"""A second batch goes to a busy worker only while batches are shorter than this: a long
task must never wait behind another while a worker that becomes ready could run it."""

MAP_PREFETCH_BELOW_SECONDS = 2 * MAP_BATCH_SECONDS
"""A ``map``'s next batch goes to a busy worker while its batch is shorter than this (a map's
batches are sized to :data:`MAP_BATCH_SECONDS`): the worker then goes from batch to batch
without waiting for the master. At 512 workers on 2 CPUs that wait, one thread's wake-up
among hundreds, cost a map of 10 ms tasks an eighth of its throughput; a batch that waits behind
another, at the map's end, waits this long at most."""

PREFETCH_MAX_BYTES = 32 * 1024
"""A prefetch waits in the worker's socket until its current batch is done: it must fit in
the socket buffer, or the master's send would block."""

MIN_SPLIT_SECONDS = 0.001
"""Work below which a share is not worth a message of its own: a batch may then take up to a
full fair share."""

AUTO_UNITS_PER_WORKER = 64
"""Units per worker of a ``map`` without ``chunksize``: fine enough that its last units
balance well, coarse enough that per-unit costs vanish for tiny tasks."""

AUTO_UNITS_MAX = 2048
"""Units of a ``map`` at most (at least 4 per worker): with hundreds of workers the last
units travel one per message, and those messages, not the work, would set the pace. At 512
workers that is 4 each, as multiprocessing's default chunksize: 4,096 (8 each) cost a map of
10 ms tasks there some 4 % of its throughput; pools of up to 32 workers are not concerned."""

MIN_UNIT_SECONDS = 0.001
"""Work a unit should hold when the function's time per item is known from an earlier call:
fewer units for tiny tasks, never fewer than multiprocessing's 4 per worker."""

ESTIMATE_WEIGHT = 0.2
"""Weight of the newest batch in a call's running mean of one unit's time."""


def auto_units(processes: int, items: int, per_item: float | None) -> int:
    """Units to cut a ``map`` of ``items`` into, on ``processes`` workers, given the
    function's known time per item (None if unknown)."""
    units = min(AUTO_UNITS_PER_WORKER * processes, max(4 * processes, AUTO_UNITS_MAX))
    if per_item is not None:
        units = min(units, max(4 * processes, int(per_item * items / MIN_UNIT_SECONDS)))
    return min(items, units)


def unit_bounds(items: int, units: int) -> list[int]:
    """Where each of ``units`` units of ``items`` starts (and the end): sizes differ by one at most."""
    q, r = divmod(items, units or 1)
    return [i * q + min(i, r) for i in range(units + 1)]


def estimate(unit_seconds: float | None, per_item: float | None, count: int) -> tuple[float | None, bool]:
    """Seconds a unit of ``count`` items should take, and whether its call measured it:
    the call's own running mean, else the function's time per item in an earlier call."""
    if unit_seconds is not None:
        return unit_seconds, True
    return (None if per_item is None else per_item * count), False


def updated(mean: float | None, seconds: float) -> float:
    """A call's running mean of one unit's time, after a batch whose units took ``seconds`` each."""
    return seconds if mean is None else (1 - ESTIMATE_WEIGHT) * mean + ESTIMATE_WEIGHT * seconds


def fair_sharers(ready: int, processes: int) -> int:
    """Twice the workers that share the queue: a fair share is half of queue / workers, so that
    two batches in flight make one share. Workers still starting count: they want work soon."""
    return 2 * max(ready, processes)


def batch_size(est: float, measured: bool, queued: int, sharers: int, is_map: bool) -> int:
    """Units for one message, given one unit's estimated seconds ``est`` (over 0)."""
    share = queued // sharers
    if measured:
        # Not worth a message below MIN_SPLIT_SECONDS of work: then up to a full fair share
        # (more would leave others idle). A hint from an earlier call may be far off: no more
        # than half a share until this call's own times are known.
        share = max(share, min(int(MIN_SPLIT_SECONDS / est), 2 * queued // sharers))
    target = MAP_BATCH_SECONDS if is_map else TARGET_BATCH_SECONDS
    return max(1, min(int(target / est), MAX_BATCH_UNITS, share))


def prefetch_wanted(est: float, size: int, queued: int, sharers: int, is_map: bool) -> bool:
    """Whether a worker that is busy should get a second batch of ``size`` units now: for a
    ``map`` while every worker can still get two, otherwise while batches are short."""
    if is_map:
        return queued >= sharers
    return est * size < PREFETCH_BELOW_SECONDS


def runs_long(est: float | None, units: int, is_map: bool = False) -> bool:
    """Whether a batch of ``units`` may take long (its time unknown, or over
    :data:`PREFETCH_BELOW_SECONDS`; for work of a ``map`` sent behind it,
    :data:`MAP_PREFETCH_BELOW_SECONDS`): work sent behind it would wait there."""
    return est is None or est * units >= (MAP_PREFETCH_BELOW_SECONDS if is_map else PREFETCH_BELOW_SECONDS)


def starts_now(missing: int, starting: int, burst: int | None) -> int:
    """How many workers to start now, of ``missing``, while ``starting`` are starting and at
    most ``burst`` may be (None: no bound). Under a bound, in runs of at least half of it
    (or what is missing): each start waits for the backend's answer (a template's forks),
    so starting one at a time as each becomes ready would make that wait per worker."""
    if burst is None:
        return max(0, missing)
    room = burst - starting
    if room < min(missing, burst // 2):
        return 0
    return max(0, min(missing, room))
