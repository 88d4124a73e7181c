"""The Pool's master thread: its loop over the workers' connections and exits, deadlines,
and the live view's snapshot.

One thread per pool waits on a selector (the workers' sockets, their exit
sentinels, a wake-up socket) and hands each event to :mod:`~fiber_core.parallel.pool.events`;
then it dispatches work, starts or retires workers, and expires deadlines.
"""

from __future__ import annotations

import heapq
import operator
import threading
import time
from typing import Any

from fiber_core.base.errors import FiberError
from fiber_core.base.log import log
from fiber_core.parallel.pool import notebook
from fiber_core.parallel.pool.dispatch import BACKUP_CHECK_SECONDS
from fiber_core.parallel.pool.events import Events
from fiber_core.parallel.pool.history import output_lines_per_worker
from fiber_core.parallel.pool.liveness import check_interval
from fiber_core.parallel.pool.table import THROUGHPUT_SECONDS, Worker

SAMPLE_SECONDS = 1.0
"""How often the master notes each worker's state in the live view's timeline (a few
microseconds per worker: nothing in the path of a task)."""

STATUS_WAIT_SECONDS = 2.0
"""How long a snapshot for the live view waits for the master thread (then it is taken
from another thread, its counts possibly one batch apart)."""


_COUNT = operator.attrgetter("count")  # a unit's items


class StatusAsk:
    """A snapshot asked of the master thread: it fills ``state`` and sets ``ready``."""

    __slots__ = ("ready", "state")

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.state: dict[str, Any] | None = None


def worker_state(w: Worker) -> str:
    """What a worker is doing, in one word, as the live view shows it."""
    if w.lost:
        return "lost"
    if w.draining:
        return "draining"
    if w.retiring:
        return "retiring"
    if w.conn is None:
        return "starting"
    if not w.ready:
        return "initializing"
    return "busy" if w.pending else "idle"


class Master(Events):
    """The master thread's loop, deadlines, and the live view."""

    _thread: threading.Thread
    _status_asks: list[StatusAsk]
    _batch_items: dict[int, int] = {}  # (replaced, never changed in place: see _snapshot_locked)

    def _master(self) -> None:
        try:
            while self._round():
                pass
        except Exception as e:  # a bug here must fail the callers, never hang them
            log.exception("fiber: pool master failed")
            self._error = FiberError(f"pool master thread failed: {e!r}")
            self._fail_all(self._error)
        finally:
            self._sel.close()  # only the master uses the selector and the read end
            self._wake_r.close()
            with self._lock:
                self._done.set()
                self._answer_status()

    def _round(self) -> bool:
        """One round of the master: wait for events, take them in, then act; False: the pool ended."""
        # A result or a ready message gives room to its worker only: dispatching to
        # it alone keeps a message's cost independent of the pool's size. Anything
        # else (new work, re-queued work, a resize, a quiet second) looks at all.
        timeout = BACKUP_CHECK_SECONDS if self._backup is not None and self._calls else 1.0
        if self._heartbeat_timeout:
            timeout = min(timeout, check_interval(self._heartbeat_timeout))
        if self._deadlines:
            with self._lock:
                left = self._expire_deadlines()
            if left is not None:
                timeout = min(timeout, left)
        touched = self._take_events(self._sel.select(timeout))
        if self._heartbeat_timeout:  # the throttle written out: this runs once per round
            now = time.monotonic()
            if now >= self._silence_check_at:
                self._check_silence(now)
        if self._requeued:
            self._requeued = False
            touched = None
        while not self._incoming.empty():
            self._adopt(*self._incoming.get())
        with self._lock:
            now = time.monotonic()
            if now >= self._sample_at:
                self._sample_states(now)
            if self._status_asks:
                self._answer_status()
            if self._state == "TERMINATE":
                return False
            return self._act(touched)

    def _take_events(self, events: list) -> list[Worker] | None:
        """Hand each event to its handler; return the workers whose messages came (None: look at all)."""
        touched: list[Worker] | None = [] if events else None
        for key, _ in events:
            kind, w = key.data
            if kind == "wake":
                try:
                    self._wake_r.recv(4096)
                except OSError:
                    pass
                touched = None
            elif kind == "conn":
                self._on_message(w)
                if touched is not None:
                    touched.append(w)
            elif kind == "exit":
                self._on_exit(w)
                touched = None
        return touched

    def _act(self, touched: list[Worker] | None) -> bool:
        """Dispatch, start, retire (lock held); False once a closed pool has nothing left."""
        if self._start_retry_at is not None and time.monotonic() >= self._start_retry_at:
            self._top_up()
        self._dispatch(touched)
        if self._state == "RUN" or self._queue:
            self._grow()
            self._shrink_idle()
            self._leave_crowded()
        if self._backup is not None and not self._queue:
            self._start_backups()
        if self._state == "CLOSE" and not self._calls and not self._queue:
            self._retire_all()
            if not self._workers:
                return False
        return True

    def _sample_states(self, now: float) -> None:
        """Note each worker's state in the timeline, which keeps only changes (lock held)."""
        self._sample_at = now + SAMPLE_SECONDS
        observe = self._timeline.observe
        for w in self._workers.values():
            job = w.process.job
            observe(now, w.id, w.process.name, job.id if job is not None else None,
                    job.host if job is not None else None, worker_state(w))

    def _set_deadline(self, call: Any, deadline: float | None) -> None:
        if deadline is None:
            return
        with self._lock:
            heapq.heappush(self._deadlines, (time.monotonic() + deadline, call.call_id, deadline, call))
        self._wake()

    def _expire_deadlines(self) -> float | None:
        """Fail the calls whose deadline passed; return the seconds to the next one. Lock held."""
        now = time.monotonic()
        while self._deadlines:
            at, call_id, seconds, call = self._deadlines[0]
            if at > now:
                return at - now
            heapq.heappop(self._deadlines)
            if call_id in self._calls:
                self.cancel_call(call)
                call.expire(seconds)
        return None

    def status_snapshot(self) -> dict[str, Any]:
        """The pool's state for the live view (:mod:`fiber_core.runtime.status`).

        Taken by the master thread between two rounds, under the pool lock, so that its
        counts add up: every task of a call is queued, running or done. Waits at most
        :data:`STATUS_WAIT_SECONDS` for the master (busy in a callback, say); then, or once
        the master has ended, it is taken here under the lock.
        """
        if threading.current_thread() is not self._thread:
            ask = StatusAsk()
            with self._lock:
                alive = not self._done.is_set()
                if alive:
                    self._status_asks.append(ask)
            if alive:
                self._wake()
                if ask.ready.wait(STATUS_WAIT_SECONDS) and ask.state is not None:
                    return ask.state
        with self._lock:
            return self._snapshot_locked()

    def _repr_html_(self) -> str:
        """The pool's summary as HTML (a notebook shows it): :func:`notebook.pool_html`."""
        return notebook.pool_html(self.status_snapshot())

    def _ipython_display_(self) -> None:
        """``display(pool)`` in a notebook: the summary, updated while the pool runs."""
        notebook.show_pool(self)

    def _answer_status(self) -> None:
        """Answer the snapshots asked for (lock held)."""
        asks, self._status_asks = self._status_asks, []
        if asks:
            state = self._snapshot_locked()
            for ask in asks:
                ask.state = state
                ask.ready.set()

    def _cost_per_hour(self, workers: int) -> float | None:
        """What ``workers`` cost per hour, where prices are known (the facade knows them)."""
        return None

    def _snapshot_locked(self) -> dict[str, Any]:
        now = time.monotonic()
        queued = sum(map(_COUNT, self._queue))
        running = 0
        # A unit that a backup copy runs too is counted once; only a pool with backups has such.
        seen: set[int] | None = set() if self._backup is not None else None
        workers = []
        lines = output_lines_per_worker(len(self._workers))
        # Items per pending batch, counted once per batch: a batch does not change while it
        # is pending, and a million units in flight would take the master tens of ms a look.
        known, self._batch_items = self._batch_items, {}
        for w in list(self._workers.values()):
            in_flight = 0
            for batch_id, batch in list(w.pending.items()):
                n = known.get(batch_id)
                self._batch_items[batch_id] = n = sum(map(_COUNT, batch)) if n is None else n
                in_flight += n
            batches = list(w.pending.values()) if seen is not None else []
            if w.culprit is not None:  # lost while it ran this one: its exit decides
                in_flight += w.culprit[0].count
                batches.append([w.culprit[0]])
            if w.ran:  # lost while it ran these, on spot capacity: its exit decides where they go
                in_flight += sum(map(_COUNT, w.ran))
                batches.append(w.ran)
            if seen is None:
                running += in_flight
            else:
                for u in (u for batch in batches for u in batch):
                    if id(u) not in seen:
                        seen.add(id(u))
                        running += u.count
            job = w.process.job
            workers.append({
                "name": w.process.name,
                "id": job.id if job is not None else None,
                "backend": self._backend_name,
                "host": job.host if job is not None else None,
                "state": worker_state(w),
                "for_seconds": round(now - w.since, 3),
                "done": w.items_done,
                "in_flight": in_flight,
                "output": w.process.output_tail(lines),
                **w.usage.view(now),
            })
        return {
            "id": self._id[:8],
            "state": self._state,
            "error": None if self._error is None else str(self._error),
            "backend": self._backend_name,
            "size": self._processes,
            "min_size": self._min,
            "elastic": self._min < self._processes,
            "age_seconds": round(now - self._created, 3),
            "tasks": {"queued": queued, "running": running, "done": self._tasks_done,
                      "failed": self._tasks_failed},
            "throughput": round(self._throughput.rate(now, THROUGHPUT_SECONDS, self._created), 3),
            "throughput_seconds": THROUGHPUT_SECONDS,
            "throughput_history": self._throughput.series(now),
            "losses": dict(self._losses_by),
            "last_loss": self._last_loss,
            "calls": [call.progress() for call in list(self._calls.values())],
            "workers": workers,
            "cost_per_hour": self._cost_per_hour(sum(1 for w in workers if w["state"] != "lost")),
            **self._timeline.view(now),
        }
