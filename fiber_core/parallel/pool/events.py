"""What the Pool's workers say and how they end: results, drains, losses.

The master thread calls these for each message of a worker's connection and for
each worker's exit. What a loss costs whom is the ledger's
(:mod:`~fiber_core.parallel.pool.ledger`); this module applies it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from fiber_core.base.errors import FiberError, JobStartError, TaskLostError
from fiber_core.base.log import log
from fiber_core.contract.jobs import EndReason
from fiber_core.parallel.pool import planner
from fiber_core.parallel.pool.dispatch import Dispatcher
from fiber_core.parallel.pool.history import LOSS_LINES
from fiber_core.parallel.pool.ledger import (
    Fault,
    Start,
    charge,
    fault_of,
    lost_message,
    running_item,
)
from fiber_core.parallel.pool.liveness import check_interval, silent
from fiber_core.parallel.pool.results import task_error
from fiber_core.parallel.pool.table import UNGRANTED_BACKOFF_SECONDS, Unit, Worker, describe, end_of
from fiber_core.parallel.pool.worker import FUNC_CACHE
from fiber_core.wire.messages import (
    POOL_DRAIN,
    POOL_HEARTBEAT,
    POOL_READY,
    POOL_RESULTS,
    POOL_RUNNING,
    decode_pool_drain,
    decode_pool_heartbeat,
    decode_pool_results,
    decode_pool_running,
    kind_of,
    unexpected,
)


class Events(Dispatcher):
    """Takes in what the workers send, and their deaths."""

    _on_demand_after: int | None = None  # Flyte's rule (on_demand.py): set, the batch a lost worker ran waits for its end

    def _on_message(self, w: Worker) -> None:
        assert w.conn is not None
        try:
            msg = w.conn.recv_bytes()
        except (EOFError, OSError):
            self._lose(w)
            return
        op = kind_of(msg)
        if op == POOL_RESULTS:
            self._on_results(w, msg)
        elif op == POOL_RUNNING:
            w.running = decode_pool_running(msg)
        elif op == POOL_HEARTBEAT:  # (a result counts as a heartbeat too: _on_results)
            w.heard = time.monotonic()
            w.usage.add(w.heard, decode_pool_heartbeat(msg))
        elif op == POOL_DRAIN:
            self._on_drain(w, decode_pool_drain(msg))
        elif op == POOL_READY:
            w.ready = True
            w.heard = w.since = time.monotonic()
            self._streak.ready()
            with self._lock:
                if self._state == "RUN" or self._queue:
                    self._top_up()
        else:
            # Not a message of this pool: the worker is cut off (it exits) and its tasks
            # go to the others.
            log.error("fiber: %s", unexpected(msg, f"the connection of {w.process.name}"))
            self._lose(w)

    def _on_results(self, w: Worker, msg: bytes) -> None:
        """A batch's results: deliver them, learn from its time, count them."""
        try:
            batch_id, elapsed, results = decode_pool_results(msg)
        except Exception as e:
            self._on_unreadable(w, e)
            return
        units = w.pending.pop(batch_id)
        w.last_work = w.heard = now = time.monotonic()
        if not w.pending:
            w.since = now
        if w.sent:
            w.sent.pop(batch_id, None)
        if not results:  # skipped: its job was cancelled
            for unit in units if self._backup is not None else ():
                unit.copies -= 1
            self._retire_if_done(w)
            return
        if units[0].call_id in self._calls:
            self._timed(units, elapsed)
        w.running = None
        done = self._deliver(units, results)
        if done:  # the live view's counters: a few operations per batch
            w.items_done += done
            self._tasks_done += done
            self._throughput.add(now, done)
        self._retire_if_done(w)

    def _on_unreadable(self, w: Worker, e: Exception) -> None:
        """Results pickled in the worker that cannot be rebuilt here. A worker answers its
        batches in order, so they answer its oldest pending one: its units fail."""
        err = FiberError(f"cannot unpickle a result sent by {w.process.name}: {e!r}")
        for unit in w.pending.pop(next(iter(w.pending))):
            if self._backup is not None:
                unit.copies -= 1
                unit.delivered = True
            unit.call.set_unit(unit.index, False, err)
            self._tasks_done += unit.count
            self._tasks_failed += unit.count
        self._retire_if_done(w)

    def _timed(self, units: list[Unit], elapsed: float) -> None:
        """A batch of ``units`` took ``elapsed`` seconds: the call's estimate and the function's."""
        call_id = units[0].call_id
        self._unit_seconds[call_id] = planner.updated(self._unit_seconds.get(call_id), elapsed / len(units))
        key = hash(units[0].func_bytes)
        self._item_seconds[key] = elapsed / max(1, sum(u.count for u in units))
        self._item_seconds.move_to_end(key)
        if len(self._item_seconds) > FUNC_CACHE:
            self._item_seconds.popitem(last=False)

    def _deliver(self, units: list[Unit], results: list) -> int:
        """Hand each unit's result to its call (or run it again, if it raised and may);
        return the items delivered."""
        backup = self._backup is not None
        done = 0
        key = units[0].call.durable
        journalled = key is not None and key.journal is not None
        delivered: list[tuple[Unit, bool, Any]] = []  # with a journal: delivered once recorded
        for unit, (ok, value) in zip(units, results):
            if backup:
                unit.copies -= 1
                if unit.delivered:
                    continue  # a backup copy's result came first
            if not ok:
                if unit.retries > 0:  # the caller opted in: run it again
                    unit.retries -= 1
                    self._requeue([unit])
                    continue
                value = task_error(unit, ok, value)
                ok = False
                self._tasks_failed += unit.count
            if backup:
                unit.delivered = True
            if journalled:
                delivered.append((unit, ok, value))
            else:
                unit.call.set_unit(unit.index, ok, value)
            done += unit.count
        if delivered:  # recorded before the caller has them (it may change them)
            key.finished([(unit.index, value) for unit, ok, value in delivered if ok])
            for unit, ok, value in delivered:
                unit.call.set_unit(unit.index, ok, value)
        return done

    def _on_drain(self, w: Worker, keep: int) -> None:
        """The worker was told to stop: take back every batch but the one it finishes."""
        w.draining = w.retiring = True
        w.since = time.monotonic()
        back = [units for batch, units in w.pending.items() if batch != keep]
        w.pending = {batch: units for batch, units in w.pending.items() if batch == keep}
        for units in back if self._backup is not None else ():
            for unit in units:
                unit.copies -= 1
        self._requeue([u for units in back for u in units])
        log.info("fiber: pool worker %s is stopping (SIGTERM): %d batches handed back",
                 w.process.name, len(back))
        self._retire_if_done(w)
        with self._lock:
            if self._state == "RUN" or self._queue:
                self._top_up()

    def _lose(self, w: Worker) -> None:
        """The worker's connection ended: put its tasks back at the front of the queue.

        Only the item it said it had started may be charged for its death, once its
        exit says why it died (:meth:`_on_exit`); until then it is held. A worker runs
        its batches in order, so that item is in its oldest pending batch, if that
        batch is watched (:func:`~fiber_core.parallel.pool.ledger.running_item`). A
        batch that is not watched does not say which item ran: none is charged, and
        each of its units runs again alone and watched, so that an item that kills
        its worker is found.
        """
        if w.lost:
            return
        w.lost = True
        w.since = time.monotonic()
        if w.conn is not None:
            if not w.conn.closed:
                try:
                    self._sel.unregister(w.conn.fileno())
                except (KeyError, ValueError, OSError):
                    pass
            w.conn.close()
        with self._lock:
            batches = list(w.pending.items())
            w.pending.clear()
            w.sent.clear()
            for _, units in batches if self._backup is not None else ():
                for unit in units:
                    unit.copies -= 1
            if not batches:
                return
            w.held_work = True
            if not w.draining:
                batch_id, first = batches[0]
                item = running_item(batch_id, first, w.running)
                if item is not None:
                    w.culprit = (first[0], item)
                    batches[0] = (batch_id, [])
                else:  # no item of it is known to have started: each runs again alone, watched
                    for unit in first:
                        unit.watch = True
            if self._on_demand_after is not None:  # its end says where they go next (_place_ran)
                w.ran, batches[0] = batches[0][1], (batches[0][0], [])
            self._requeue([u for _, units in batches for u in units])

    def _check_silence(self, now: float) -> None:
        """Every heartbeat interval: a worker silent past ``heartbeat_timeout`` is lost."""
        timeout = self._heartbeat_timeout
        self._silence_check_at = now + check_interval(timeout)
        for w in list(self._workers.values()):
            if w.conn is None or w.lost or not silent(w.heard, now, timeout):
                continue
            if not w.conn.closed and w.conn.poll(0):
                w.heard = now  # its messages wait: the master was behind, not the worker
                continue
            self._unresponsive(w, now - w.heard)

    def _unresponsive(self, w: Worker, quiet: float) -> None:
        """A worker sent nothing for ``quiet`` seconds (frozen, or a task holding the GIL):
        its work runs elsewhere now, and its job is stopped; its exit charges the item it ran."""
        w.unresponsive = f"no heartbeat for {quiet:.1f} s, heartbeat_timeout {self._heartbeat_timeout:g} s"
        log.warning("fiber: pool worker %s stopped answering (%s): it is stopped and its tasks "
                    "run elsewhere", w.process.name, w.unresponsive)
        self._lose(w)
        # In a thread: the way to a frozen worker's host may be cut, and a backend's stop
        # would then hold up the master.
        threading.Thread(target=_kill, args=(w,), daemon=True, name="fiber-pool-stop").start()

    def _on_exit(self, w: Worker) -> None:
        # What the worker sent before it ended comes first (its exit and its last messages
        # may be seen in the same round): a result, or which item it started, which is
        # the one its death is charged to.
        while w.conn is not None and not w.lost and not w.conn.closed and w.conn.poll(0):
            self._on_message(w)
        self._lose(w)
        try:
            self._sel.unregister(w.process.sentinel)
        except (KeyError, ValueError):
            pass
        w.process.join()
        code, reason, detail = end_of(w)
        culprit, w.culprit = w.culprit, None
        if culprit is not None and culprit[0].delivered:
            culprit = None  # a backup copy delivered it
        with self._lock:
            self._workers.pop(w.id, None)
            if self._state == "TERMINATE":
                return
            what = describe(w, code, reason, detail, self._resources.get("memory"))
            fault = fault_of(code, reason, w.draining)
            stays = self._place_ran(w, reason, culprit)
            if stays is not None:
                self._charge(stays[0], stays[1], fault, what)
            retired = w.retiring and not w.draining and culprit is None
            # (a worker that did its maxtasksperchild and left is replaced, not lost)
            lost = not retired and not (code == 0 and self._maxtasks is not None
                                        and w.assigned >= self._maxtasks)
            self._note_end(w, "retired" if retired else reason.value if reason is not None else "unknown",
                           what, lost)
            if retired:
                return
            if lost:
                self._losses_by[reason.value if reason is not None else "unknown"] += 1
                self._last_loss = what
            if self._state == "CLOSE" and not self._queue and not self._calls:
                return  # closing, and nothing is left to do
            if not self._after_loss(w, code, reason, fault, culprit is not None, what):
                self._top_up()

    def _place_ran(self, w: Worker, reason: EndReason | None,
                   culprit: tuple[Unit, int] | None) -> tuple[Unit, int] | None:
        """Where the units of the batch a lost worker ran go, once its end is known (lock held):
        back to the queue, the culprit to the ledger (returned). A pool on spot capacity may
        send some to on-demand workers instead (:mod:`~fiber_core.parallel.pool.on_demand`)."""
        held, w.ran = w.ran, []
        self._requeue(held)
        return culprit

    def _note_end(self, w: Worker, reason: str, what: str, lost: bool) -> None:
        """The live view's timeline: ``w`` ended, for ``reason`` (lock held)."""
        job = w.process.job
        self._timeline.ended(
            time.monotonic(), w.id, w.process.name, job.id if job is not None else None,
            job.host if job is not None else None, reason=reason, description=what, lost=lost,
            lines=w.process.output_tail(LOSS_LINES) if lost else [])

    def _charge(self, unit: Unit, item: int, fault: Fault, what: str) -> None:
        """The worker died while ``item`` of ``unit`` ran: charge it, then run it again or fail it."""
        if fault is Fault.NONE:
            self._requeue([unit])
            return
        if unit.charges is None:
            unit.charges = {}
        count, fails = charge(unit.charges, item, fault, self._task_losses)
        if fails:
            unit.call.set_unit(unit.index, False, TaskLostError(lost_message(unit.name(item), count, fault, what)))
            self._tasks_done += unit.count
            self._tasks_failed += unit.count
        else:
            log.warning("fiber: %s while running %s; it runs again", what, unit.name(item))
            self._requeue([unit])

    def _after_loss(self, w: Worker, code: int | None, reason: EndReason | None, fault: Fault,
                    charged: bool, what: str) -> bool:
        """What a lost worker means for the pool, past the item it ran (lock held): True when
        no replacement starts now (the pool failed, or the platform declined the worker)."""
        nobodys = fault is Fault.NONE
        if nobodys and self._count_loss(what):
            return True
        if (not w.ready and reason is EndReason.NEVER_STARTED
                and any(x.ready for x in self._workers.values())):
            # Others run: the platform declined this one (no room, a quota), not a
            # broken image. The pool goes on with what it has and asks again later.
            log.info("fiber: the platform did not start pool worker %s (%s); the pool goes on "
                     "with %d and asks again in %g s", w.process.name, what,
                     sum(1 for x in self._workers.values() if x.ready), UNGRANTED_BACKOFF_SECONDS)
            self._start_retry_at = time.monotonic() + UNGRANTED_BACKOFF_SECONDS
            return True
        if not w.ready and not nobodys:
            return self._start_death(w, code, reason, what)
        if not charged and not nobodys and code not in (0, None) and not w.retiring:
            log.warning("fiber: pool worker died: %s; its tasks were re-queued", what)
            # Idle when it died: no task to charge, so the pool-wide limit bounds how often
            # this may happen. (A batch it held runs again watched instead: an item that
            # kills its worker is then found and charged.)
            return not w.held_work and self._count_loss(what)
        return False

    def _start_death(self, w: Worker, code: int | None, reason: EndReason | None, what: str) -> bool:
        """A worker died before it was ready: True when that failed the pool (lock held)."""
        verdict = self._streak.died(code, reason, connected=w.conn is not None)
        if verdict is Start.OUTSIDE:
            return self._count_loss(what + ", while starting")
        if verdict is Start.AGAIN:
            return False
        tail = w.process.log_tail()
        self._fail_pool(JobStartError(
            f"pool workers die before they are ready ({self._streak.length} in a row); the last, {what}"
            + (f"; the end of its log:\n{tail}" if tail else ""),
            exitcode=code, logs=w.process.job_logs()))
        return True


def _kill(w: Worker) -> None:
    try:
        w.process.kill()
    except (ValueError, OSError) as e:  # closed, or the backend could not reach it
        log.info("fiber: could not stop pool worker %s: %s", w.process.name, e)
