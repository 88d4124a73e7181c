"""The Pool's dispatch: which worker gets which units, in how big a batch, and backup copies.

Sizes are the planner's (:mod:`~fiber_core.parallel.pool.planner`); this module
applies them to the workers of the table and sends the batches.
"""

from __future__ import annotations

import operator
import time

from fiber_core.base.log import log
from fiber_core.parallel.pool import planner
from fiber_core.parallel.pool.results import MapResult, job_counter
from fiber_core.parallel.pool.table import Unit, Worker, WorkerTable
from fiber_core.parallel.pool.worker import FUNC_CACHE
from fiber_core.wire.messages import POOL_TASKS, TaskField, encode_pool_tasks

BACKUP_FACTOR = 3.0
"""``backup=True``: a batch is late once it has run this many times its call's measured time."""

BACKUP_CHECK_SECONDS = 0.02
"""How often the master looks for late batches while a pool with backups has calls."""

BACKUP_MIN_SECONDS = 0.01
"""No batch younger than this is late, however short its measured time."""


_START, _ATTEMPT = operator.attrgetter("start"), operator.attrgetter("attempt")


def task_field(units: list[Unit]) -> TaskField:
    """What a batch's tasks learn of their identity (``fiber_core.current_task``): the call's
    ordinal, the run's seed, each unit's first item and attempt."""
    key = units[0].call.durable
    if key is None:
        return -1, 0, [], []
    return key.ordinal, key.seed, list(map(_START, units)), list(map(_ATTEMPT, units))


class Dispatcher(WorkerTable):
    """Hands the queued units to ready workers; sends backup copies of late batches."""

    def _dispatch(self, only: list[Worker] | None = None) -> None:
        """Hand batches to ready workers (all, or ``only``) that have room. Called with the lock held."""
        if not self._queue:
            return
        ready = [w for w in (self._workers.values() if only is None else only)
                 if w.conn is not None and not w.lost and not w.retiring and w.ready]
        if not ready:
            return
        sharers = planner.fair_sharers(len(ready), self._processes)
        # Breadth first: every idle worker gets a batch before any gets a second.
        for level in (0, 1):
            for w in ready:
                if not self._queue:
                    return
                if len(w.pending) == level:
                    size = self._batch_for(w, level, sharers)
                    if size:
                        self._send_batch(w, size, planner.PREFETCH_MAX_BYTES if level else None)

    def _batch_for(self, w: Worker, level: int, sharers: int) -> int:
        """Units for the next batch of ``w``, which holds ``level`` batches (0: none wanted)."""
        front = self._queue[0]
        est, measured = self._estimate(front)
        if est is None:
            size = 0 if level else 1  # unknown times: one unit, and no prefetch
        else:
            est = max(est, 1e-7)
            queued = len(self._queue)
            is_map = type(front.call) is MapResult
            size = planner.batch_size(est, measured, queued, sharers, is_map)
            if level and (self._prefetch_too_big(w, front) or self._running_long(w, is_map)
                          or not planner.prefetch_wanted(est, size, queued, sharers, is_map)):
                return 0
        if size and self._maxtasks is not None:
            size = min(size, max(0, self._maxtasks - w.assigned))
        return size

    def _start_backups(self) -> None:
        """Idle workers and nothing queued: run again the batches that take far too long.

        A batch is late when it has run ``backup`` times as long as its call's
        measured time for that many units. Its copy goes to an idle worker; the
        first result is delivered, the other dropped. Called with the lock held.
        """
        idle = [w for w in self._workers.values()
                if w.conn is not None and w.ready and not w.lost and not w.retiring and not w.pending]
        if not idle:
            return
        now = time.monotonic()
        late: list[tuple[float, Worker, int]] = []
        assert self._backup is not None
        for w in self._workers.values():
            for batch_id, units in w.pending.items():
                est = self._unit_seconds.get(units[0].call_id)
                if est is None or units[0].watch or any(u.copies > 1 or u.delivered for u in units):
                    continue
                age = now - w.sent.get(batch_id, now)
                if age > max(BACKUP_MIN_SECONDS, self._backup * est * len(units)):
                    late.append((age, w, batch_id))
        late.sort(key=lambda t: -t[0])
        for (_, slow, batch_id), spare in zip(late, idle):
            units = list(slow.pending[batch_id])
            log.debug("fiber: a backup copy of a late batch (%d units) goes to %s",
                      len(units), spare.process.name)
            self._send_units(spare, units)

    def _estimate(self, unit: Unit) -> tuple[float | None, bool]:
        """Seconds ``unit`` should take, and whether its call measured that (:func:`planner.estimate`)."""
        return planner.estimate(self._unit_seconds.get(unit.call_id),
                                self._item_seconds.get(hash(unit.func_bytes)), unit.count)

    def _running_long(self, w: Worker, is_map: bool) -> bool:
        """Whether the batch a worker runs may take long: work sent behind it (of a ``map``:
        ``is_map``) would wait there while another worker, one that becomes ready meanwhile,
        could run it."""
        units = next(iter(w.pending.values()), None)
        if not units:
            return False
        return planner.runs_long(self._estimate(units[0])[0], len(units), is_map)

    def _prefetch_too_big(self, w: Worker, front: Unit) -> bool:
        """A prefetch waits in the socket until the worker is done: it must fit there."""
        size = len(front.data)
        if front.call_id not in w.funcs:
            size += len(front.func_bytes)
        return size > planner.PREFETCH_MAX_BYTES

    def _send_batch(self, w: Worker, n: int, max_bytes: int | None = None) -> None:
        units: list[Unit] = []
        first = self._queue[0]
        nbytes = 0
        while self._queue and len(units) < n:
            u = self._queue[0]
            if u.call_id != first.call_id:
                break
            if units and (u.watch or first.watch):
                break  # a unit that may have killed its worker goes alone, watched
            nbytes += len(u.data)
            if units and max_bytes is not None and nbytes > max_bytes:
                break
            units.append(self._queue.popleft())
        self._send_units(w, units)

    def _send_units(self, w: Worker, units: list[Unit]) -> None:
        first = units[0]
        batch_id = next(job_counter)
        if self._backup is not None:
            for u in units:
                u.copies += 1
            w.sent[batch_id] = time.monotonic()
        send_func = first.call_id not in w.funcs
        if send_func:
            # A finished call's function is not sent again: no entry outlives its map (each
            # would hold on to a block of memory that the map's objects had filled).
            for fid in [f for f in w.funcs if f not in self._calls]:
                del w.funcs[fid]
            w.funcs[first.call_id] = None
            if len(w.funcs) > FUNC_CACHE:
                w.funcs.popitem(last=False)
        payload = encode_pool_tasks(batch_id, first.call_id, first.func_bytes if send_func else None,
                                    first.kind, [u.data for u in units], first.watch, task_field(units))
        now = time.monotonic()
        if not w.pending:
            w.since = now
        w.pending[batch_id] = units
        w.assigned += len(units)
        w.last_work = now
        assert w.conn is not None
        try:
            w.conn.send_frame(POOL_TASKS, payload)
        except OSError:
            pass  # its exit or EOF re-queues the batch
