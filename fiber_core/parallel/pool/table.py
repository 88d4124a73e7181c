"""The Pool's worker table: its workers and their work, starting, retiring and failing them.

:class:`WorkerTable` holds the state that the master thread and the callers share,
under one lock: the queue of units, the calls in flight, the workers (a
:class:`Worker` each: its job, its connection, the batches it holds). It starts
workers (a few at a time on this machine's CPUs, with a backoff while the backend
refuses), retires them, and fails the pool when it cannot go on. The master loop
(:mod:`~fiber_core.parallel.pool.master`) and the facade
(:mod:`~fiber_core.parallel.pool.facade`) build on it.
"""

from __future__ import annotations

import collections
import itertools
import os
import queue as _queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from fiber_core.base.errors import BackendError
from fiber_core.base.fds import OUT_OF_DESCRIPTORS, limit_error
from fiber_core.base.log import log
from fiber_core.contract.jobs import EndReason
from fiber_core.parallel.pool.history import Throughput, Timeline
from fiber_core.parallel.pool.ledger import (
    LOSS_LIMIT,
    LOSS_WINDOW,
    Fault,
    LossWindow,
    StartStreak,
    describe_end,
)
from fiber_core.parallel.pool.liveness import UsageLog, heartbeat_interval
from fiber_core.parallel.pool.planner import starts_now
from fiber_core.parallel.pool.results import ApplyResult
from fiber_core.parallel.pool.worker import worker_main
from fiber_core.processes.process import Process, cpu_count, start_processes
from fiber_core.runtime.config import config
from fiber_core.runtime.run import runtime
from fiber_core.wire.framing import Connection
from fiber_core.wire.messages import POOL_QUIT, MessageError, decode_pool_hello, encode_pool_cancel
from fiber_core.wire.serialize import loads

START_RETRY_SECONDS = 300.0
"""How long a backend that refuses to start replacements (a daemon restarting, an API
briefly unreachable) is retried before the pool fails."""

START_BACKOFF_SECONDS = 0.5
"""The first wait before starting again after a refusal; it doubles after each one ..."""

START_BACKOFF_MAX_SECONDS = 15.0
"""... up to this."""

THROUGHPUT_SECONDS = 10
"""The live view's throughput: tasks done per second over this many seconds."""

IDLE_TIMEOUT = 60.0
"""Seconds a worker beyond an elastic pool's minimum may stay idle before it goes."""

PROBE_SECONDS = 0.2
"""While its backend refuses to start workers, how often the pool asks it whether it answers
again (``Backend.probe``): the next try comes as soon as it does, not at the end of the backoff."""

CROWDED_CHECK_SECONDS = 1.0
"""How often the pool asks its backend which workers crowd a machine while another has
room (``Backend.crowded_jobs``): such a worker goes between tasks, its replacement goes
where there is room."""

UNGRANTED_BACKOFF_SECONDS = 10.0
"""After the platform declined a worker (it never started while others run), seconds
before the pool asks again."""


def end_of(w: Worker) -> tuple[int | None, EndReason | None, str]:
    """A lost worker's exit code, end reason and the platform's detail, as far as known."""
    code = w.process.exitcode
    if w.unresponsive is not None:  # the master stopped it: the backend says only that
        return code, EndReason.UNRESPONSIVE, w.unresponsive
    job = w.process.job
    if job is None or not job.state.done():
        return code, None, ""
    return code, job.state.reason, job.state.detail


def describe(w: Worker, code: int | None, reason: EndReason | None, detail: str,
             memory: Any = None) -> str:
    """What happened to a worker, for people (:func:`~fiber_core.parallel.pool.ledger.describe_end`);
    ``memory``: the pool's memory setting, if its job's spec does not say."""
    job = w.process.job
    if job is not None and job.spec.memory:
        memory = job.spec.memory
    return describe_end(w.process.name, code, reason, detail, memory)


def out_of_descriptors(e: BaseException | None) -> OSError | None:
    """``e`` as an error naming the descriptor limit, if it (or its cause) is this process
    running out of descriptors."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in OUT_OF_DESCRIPTORS:
            return e if "out of file descriptors" in str(e) else limit_error(e)
        e = e.__cause__
    return None


class Unit:
    __slots__ = ("call", "index", "data", "charges", "call_id", "func_bytes", "kind", "count",
                 "start", "watch", "retries", "delivered", "copies", "attempt", "preemptions")

    def __init__(self, call: Any, index: int, data: bytes, call_id: int, func_bytes: bytes,
                 kind: int, count: int = 1, start: int = 0, retries: int = 0) -> None:
        self.call, self.index, self.data = call, index, data
        self.call_id, self.func_bytes, self.kind = call_id, func_bytes, kind
        self.count = count  # items in the unit
        self.start = start  # the input position of its first item
        self.charges: dict[tuple[int, Fault], int] | None = None  # deaths charged, per item and kind
        self.watch = False  # a worker died while it may have run: it runs alone, watched
        self.retries = retries  # runs left after it raised (an opt-in)
        self.delivered = False  # its result was delivered: another copy's is dropped
        self.copies = 0  # workers that hold it (two while a backup copy runs)
        self.attempt = 0  # times it went back to the queue (its tasks' attempt, current_task)
        self.preemptions = 0  # times a worker running it was preempted (on_demand.py)
        # (delivered and copies are kept only in a pool with backup tasks: elsewhere a unit is
        # never in two places, and the pool's hot path does not pay for them)

    def name(self, item: int | None = None) -> str:
        """The task, as an error names it: ``item 17 of map(f)``, ``apply_async(f, (3,))``."""
        call = getattr(self.call, "call_name", "a task")
        if type(self.call) is ApplyResult:
            try:  # only for an error: the arguments are shown from this process's own pickle
                args = loads(self.data)[0][0]
            except Exception:
                return call
            shown = repr(args)
            return f"{call[:-1]}, {shown if len(shown) <= 80 else shown[:77] + '...'})"
        if item is None and self.count == 1:
            item = 0
        if item is not None:
            return f"item {self.start + item} of {call}"
        return f"items {self.start}-{self.start + self.count - 1} of {call}"


class Worker:
    def __init__(self, wid: int, process: Process) -> None:
        self.id = wid
        self.process = process
        self.conn: Connection | None = None
        self.ready = False
        self.lost = False
        self.retiring = False
        self.pending: dict[int, list[Unit]] = {}
        self.assigned = 0
        self.running: tuple[int, int] | None = None  # (batch, item) a watched batch runs
        self.culprit: tuple[Unit, int] | None = None  # the item it ran when it died
        self.ran: list[Unit] = []  # the batch it ran when lost, held until its end is known (on_demand.py)
        self.draining = False  # it was told to stop (SIGTERM) and hands its work back
        self.sent: dict[int, float] = {}  # when each pending batch was sent (for backups)
        self.held_work = False  # it held batches when it was lost
        self.funcs: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.last_work = time.monotonic()  # when it was last given work or answered
        self.since = self.last_work  # when its state (as the live view shows it) last changed
        self.items_done = 0  # tasks (items) whose results it delivered
        self.heard = self.last_work  # when its last heartbeat or result came
        self.unresponsive: str | None = None  # why the master found it frozen and stopped it
        self.usage = UsageLog()  # what it uses, from its heartbeats, for the live view


class WorkerTable:
    """The pool's workers and work, under one lock (``_lock``), and what starts, retires and fails them."""

    def __init__(self, *, processes: int, min_processes: int, idle_timeout: float,
                 initializer: Callable | None, initargs: tuple, maxtasks: int | None,
                 backend: str | None, retries: int, task_losses: int,
                 loss_limit: tuple[int, float] | None, backup: float | None,
                 resources: dict[str, Any]) -> None:
        self._min = min_processes
        self._idle_timeout = float(idle_timeout)
        self._idle_check_at = 0.0
        self._retries = retries
        self._task_losses = task_losses
        self._loss_limit = loss_limit
        self._backup = backup
        self._heartbeat_timeout = float(config.get("heartbeat_timeout"))
        self._silence_check_at = 0.0
        self._losses = LossWindow(LOSS_LIMIT, LOSS_WINDOW)  # workers lost to nobody's fault
        self._deadlines: list[tuple[float, int, float, Any]] = []  # heap of (when, call id, s, call)
        self._started = False  # the first workers started: later start errors are retried
        self._start_retry_at: float | None = None  # starts are refused: the next try
        self._start_failing_since: float | None = None
        self._start_backoff = START_BACKOFF_SECONDS
        self._prober: threading.Thread | None = None  # asks the backend whether it answers again
        self._initializer = initializer
        self._initargs = tuple(initargs)
        self._maxtasks = maxtasks
        self._backend = backend
        meta = getattr(initializer, "__fiber_meta__", None) or {}
        self._resources = {k: v for k, v in {**meta, **resources}.items() if v is not None}
        self._processes = processes
        self._worker_name = "PoolWorker"  # a role's workers: PoolWorker-<role> (facade.py)
        self._id = os.urandom(16).hex()
        self._lock = threading.RLock()  # callbacks may call back into the pool
        self._queue: collections.deque[Unit] = collections.deque()
        self._workers: dict[int, Worker] = {}
        self._wid = itertools.count(1)
        self._calls: dict[int, Any] = {}
        self._state = "RUN"
        self._error: BaseException | None = None
        self._streak = StartStreak()  # workers in a row that died before they were ready
        self._unit_seconds: dict[int, float] = {}  # per call: running mean of one unit's time
        # per pickled function: the last call's mean time per item, to size a new call's first batches
        # (keyed by the hash of the pickle: no big closure is kept alive for this)
        self._item_seconds: collections.OrderedDict[int, float] = collections.OrderedDict()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        self._incoming: _queue.SimpleQueue[tuple[int, socket.socket]] = _queue.SimpleQueue()
        self._done = threading.Event()
        self._requeued = False  # the master must offer re-queued work to every worker
        # For the live view (runtime/status.py): counters the master keeps as it goes, read
        # only when a snapshot is asked for.
        self._created = time.monotonic()
        self._tasks_done = 0  # tasks (items) whose result was delivered, failed ones too
        self._tasks_failed = 0
        self._throughput = Throughput()  # tasks done over time
        self._timeline = Timeline()  # each worker's states and end, the losses
        self._sample_at = 0.0  # when the master next notes each worker's state in the timeline
        self._losses_by: collections.Counter[str] = collections.Counter()  # EndReason value
        self._last_loss = ""
        # What the workers' backend reaches this process at (also put in pickled queues).
        workers_backend = runtime().get_backend(backend)
        self._workers_backend = workers_backend
        self._crowded_check_at = 0.0
        self._backend_name = workers_backend.name
        self._hub = runtime().addresses_for(workers_backend)
        # Workers that start on this machine's CPUs start a few at a time (see _top_up).
        self._burst = cpu_count() * workers_backend.starts_per_cpu if workers_backend.shares_this_machine else None

    def _start_workers(self, n: int) -> None:
        """Start ``n`` workers with one group start of the backend (``Backend.start_jobs``)."""
        made = []
        for _ in range(n):
            wid = next(self._wid)
            made.append((wid, Process(
                target=worker_main, name=f"{self._worker_name}-{wid}", daemon=True, backend=self._backend,
                args=(self._hub, self._id, wid, self._initializer, self._initargs, self._maxtasks,
                      heartbeat_interval(self._heartbeat_timeout)),
                **self._resources)))
        start_processes([p for _, p in made])
        for wid, p in made:
            w = Worker(wid, p)
            self._workers[wid] = w
            self._watch(p.sentinel, ("exit", w))

    def _watch(self, fileobj: Any, data: tuple) -> None:
        """Add a descriptor to the master's selector.

        A descriptor number can only be registered twice if an earlier owner closed it
        without unregistering; the new owner wins rather than crashing the master.
        """
        try:
            self._sel.register(fileobj, selectors.EVENT_READ, data)
        except KeyError:
            self._sel.unregister(fileobj)
            self._sel.register(fileobj, selectors.EVENT_READ, data)

    def _on_connect(self, target: str, sock: socket.socket) -> None:
        # Runs in a hub thread: read the hello, hand the socket to the master.
        try:
            wid = decode_pool_hello(Connection(sock).recv_bytes())
        except (EOFError, OSError, MessageError):
            sock.close()
            return
        self._incoming.put((wid, sock))
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")  # any byte: it only wakes the master
        except (BlockingIOError, OSError):
            pass

    def _adopt(self, wid: int, sock: socket.socket) -> None:
        w = self._workers.get(wid)
        if w is None or w.lost or w.conn is not None:
            sock.close()
            return
        w.conn = Connection(sock)
        w.heard = w.since = time.monotonic()
        self._watch(sock, ("conn", w))
        if w.retiring:
            try:
                w.conn.send_frame(POOL_QUIT)
            except OSError:
                pass

    def _retire_if_done(self, w: Worker) -> None:
        if w.retiring and not w.pending and w.conn is not None:
            try:
                w.conn.send_frame(POOL_QUIT)
            except OSError:
                pass

    def _top_up(self) -> None:
        """Start workers until the pool has its size, in one group start; called with the lock held.

        On a backend whose jobs share this machine's CPUs, at most
        ``Backend.starts_per_cpu`` workers per CPU are starting at any time: the rest start
        as those become ready (:func:`~fiber_core.parallel.pool.planner.starts_now`), so the
        first result comes after a few starts, not after all of them shared the CPUs.

        The first workers' start fails :class:`Pool` at once; after that, a backend
        that refuses (a daemon restarting, an API briefly unreachable) is retried
        with a backoff for :data:`START_RETRY_SECONDS`, then the pool fails. A
        ``RuntimeError`` (no thread to be had while the interpreter exits) and running
        out of file descriptors are no refusals that pass: they fail the pool at once,
        with an error that names the limit.
        """
        if self._start_retry_at is not None and time.monotonic() < self._start_retry_at:
            return
        if self._started and runtime().exiting:
            return  # the program ends: a replacement would outlive the backends' cleanup
        active = [w for w in self._workers.values() if not w.retiring and not w.lost]
        starting = sum(1 for w in active if not w.ready)
        n = self._target(len(active)) - len(active)
        n = starts_now(n, starting, self._burst)
        if n <= 0:
            return
        try:
            self._start_workers(n)
        except Exception as e:
            if not self._started:
                raise
            limit = out_of_descriptors(e)
            self._start_failed(limit or e, retry=not isinstance(e, RuntimeError) and limit is None)
            return
        if self._start_failing_since is not None:
            log.warning("fiber: the %s backend answers again: pool workers start (it refused for %.1f s)",
                        self._backend_name, time.monotonic() - self._start_failing_since)
        self._start_retry_at = self._start_failing_since = None

    def _target(self, active: int) -> int:
        """How many workers the pool wants: its size, or, when elastic, its maximum while
        work waits in the queue and otherwise what it has, at least its minimum."""
        if self._min == self._processes or (self._queue and self._state != "TERMINATE"):
            return self._processes
        return min(self._processes, max(self._min, active))

    def _grow(self) -> None:
        """An elastic pool with work waiting asks for workers up to its maximum (lock held)."""
        if self._queue and self._min < self._processes and len(self._workers) < self._processes:
            self._top_up()

    def _shrink_idle(self) -> None:
        """An elastic pool lets workers beyond its minimum go once idle for ``idle_timeout`` (lock held)."""
        now = time.monotonic()
        if self._min == self._processes or now < self._idle_check_at:
            return
        self._idle_check_at = now + min(1.0, self._idle_timeout / 4)
        if self._queue:
            return
        active = [w for w in self._workers.values() if not w.retiring and not w.lost]
        extra = len(active) - self._min
        if extra <= 0:
            return
        idle = [w for w in active if not w.pending and now - w.last_work >= self._idle_timeout]
        for w in sorted(idle, key=lambda w: (w.ready, w.last_work))[:extra]:
            log.info("fiber: pool worker %s was idle for %.0f s: it goes (the pool keeps %d)",
                     w.process.name, now - w.last_work, self._min)
            self._retire(w)

    def _leave_crowded(self) -> None:
        """Let go, between tasks, the workers the backend placed where they crowd a machine
        while another has room (``Backend.crowded_jobs``), and start their replacements,
        which it places where there is room: a pool moves back onto a host that returned (lock held)."""
        now = time.monotonic()
        if now < self._crowded_check_at:
            return
        self._crowded_check_at = now + CROWDED_CHECK_SECONDS
        crowded = {id(job) for job in self._workers_backend.crowded_jobs()}
        if not crowded:
            return
        moving = [w for w in self._workers.values()
                  if not w.retiring and not w.lost and id(w.process.job) in crowded]
        for w in moving:
            log.info("fiber: pool worker %s runs where another has room: it goes after its tasks, "
                     "another starts there", w.process.name)
            self._retire(w)
        if moving:
            self._top_up()

    def _retire(self, w: Worker) -> None:
        """Let a worker go: at once if idle, after its batches otherwise; one not yet
        connected (a request not granted) is stopped."""
        w.retiring = True
        w.since = time.monotonic()
        if w.conn is not None and not w.pending:
            try:
                w.conn.send_frame(POOL_QUIT)
            except OSError:
                pass
        elif w.conn is None:
            w.process.terminate()

    def _start_failed(self, e: Exception, retry: bool = True) -> None:
        now = time.monotonic()
        if self._start_failing_since is None:
            self._start_failing_since, self._start_backoff = now, START_BACKOFF_SECONDS
        failing = now - self._start_failing_since
        if not retry or failing >= START_RETRY_SECONDS:
            why = e.strerror if isinstance(e, OSError) and e.strerror else e
            err = BackendError(f"cannot start pool workers: {why}" if not retry else
                               f"cannot start pool workers: the backend has refused for "
                               f"{failing:.0f} s (START_RETRY_SECONDS); the last error: {e}")
            err.__cause__ = e
            self._fail_pool(err)
            return
        log.warning("fiber: cannot start a pool worker, waiting for the backend (again in %.1f s, "
                    "for up to %.0f s more): %s", self._start_backoff,
                    START_RETRY_SECONDS - failing, e)
        self._start_retry_at = now + self._start_backoff
        self._start_backoff = min(2 * self._start_backoff, START_BACKOFF_MAX_SECONDS)
        if self._prober is None or not self._prober.is_alive():
            self._prober = threading.Thread(target=self._probe_until_retry, daemon=True, name="fiber-pool-probe")
            try:
                self._prober.start()
            except RuntimeError:  # no thread while the interpreter exits: the backoff decides
                self._prober = None

    def _probe_until_retry(self) -> None:
        """Until the next try to start workers, ask the backend every :data:`PROBE_SECONDS`
        whether it answers (``Backend.probe``); as soon as it does, the try comes. A backend
        that cannot tell (``None``) leaves the try to the backoff."""
        pause = threading.Event()
        while True:
            with self._lock:
                at = self._start_retry_at
                if at is None or self._state == "TERMINATE" or time.monotonic() >= at:
                    return
            try:
                answers = self._workers_backend.probe()
            except Exception:
                answers = False
            if answers is None:
                return
            if answers:
                with self._lock:
                    if self._start_retry_at is not None:
                        self._start_retry_at = time.monotonic()
                self._wake()
                return
            pause.wait(PROBE_SECONDS)

    def _retire_all(self) -> None:
        for w in self._workers.values():
            if not w.retiring and not w.pending:
                w.retiring = True
                w.since = time.monotonic()
                if w.conn is not None:
                    try:
                        w.conn.send_frame(POOL_QUIT)
                    except OSError:
                        pass

    def _kill_workers(self) -> None:
        for w in list(self._workers.values()):
            w.retiring = True
            w.process.kill()

    def _count_loss(self, what: str) -> bool:
        """Count a worker lost to no task's fault; fail the pool past its limit (True)."""
        losses = self._losses
        losses.limit, losses.window = self._loss_limit or (max(LOSS_LIMIT, 10 * self._processes),
                                                           LOSS_WINDOW)
        if not losses.add(time.monotonic()):
            log.info("fiber: pool worker lost, not charged to a task: %s", what)
            return False
        self._fail_pool(BackendError(
            f"pool workers were lost {len(losses)} times within {losses.window:g} s, more than "
            f"the pool's loss_limit ({losses.limit} in {losses.window:g} s); the last: {what}. The "
            f"platform keeps taking workers: look at it, or allow more with "
            f"Pool(loss_limit=(n, seconds))"))
        return True

    def _fail_pool(self, err: BaseException) -> None:
        """The pool cannot go on: every call fails with ``err``, every worker is killed (lock held)."""
        self._error = err
        self._state = "TERMINATE"
        self._fail_all_locked(err)
        self._kill_workers()

    def _fail_all_locked(self, exc: BaseException) -> None:
        self._queue.clear()
        for call in list(self._calls.values()):
            call.fail(exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            self._fail_all_locked(exc)

    def _requeue(self, units: list[Unit]) -> None:
        """Put units back at the front of the queue, in their order (those of live calls)."""
        with self._lock:
            live = [u for u in units if u.call_id in self._calls and not u.delivered and not u.copies]
            for u in live:
                u.attempt += 1
            if live:
                self._queue.extendleft(reversed(live))
                self._requeued = True

    # -- what a call's result asks of its pool (results.py) --------------------------------

    def cancel_call(self, call: Any, settle: Callable[[], bool] | None = None) -> bool:
        """Drop a call's queued tasks and tell the workers that hold some to skip them; then
        run ``settle`` under the pool's lock (the master thread cannot finish the call
        meanwhile) and return its answer (False without one)."""
        self._drop_call(call)
        if settle is None:
            return False
        with self._lock:
            return settle()

    def _drop_call(self, call: Any) -> None:
        call_id = call.call_id
        with self._lock:
            if self._calls.pop(call_id, None) is None:
                return
            self._unit_seconds.pop(call_id, None)
            if any(u.call is call for u in self._queue):
                self._queue = collections.deque(u for u in self._queue if u.call is not call)
            for w in self._workers.values():
                if w.conn is None or w.lost:
                    continue
                if any(units[0].call is call for units in w.pending.values()):
                    try:
                        w.conn.send_frame(encode_pool_cancel(call_id))
                    except OSError:
                        pass
        self._wake()

    def end_call(self, call: Any) -> None:
        """The call is done (its result is ready, or its iterator gave everything)."""
        call_id = call.call_id
        self._calls.pop(call_id, None)
        self._unit_seconds.pop(call_id, None)
