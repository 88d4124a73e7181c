"""``Pool``: the :class:`multiprocessing.pool.Pool` API over job-backed workers.

How the pool works
------------------
Every worker is a daemonic :class:`~fiber_core.processes.process.Process` (a job on the
selected backend) that connects back to the pool's master thread and *pulls*
work: it asks for a batch when it is ready, so a slow or late worker never
holds up the others, and work starts as soon as the first worker is up.

The master thread keeps a *pending table*: which batch each worker holds. When
a worker dies (killed, out of memory, node lost), its batches go back to the
front of the queue and a replacement job is started; a result is accepted once
per task, so every result reaches the caller exactly once, and ``map`` keeps
its order. A task that raises is not retried (unless the call asks, ``retries=``):
its exception is re-raised in the caller with the remote traceback as
``__cause__``.

A death is charged only to the item the worker said it had started, and only
when the job's end reason (:class:`~fiber_core.contract.jobs.EndReason`) says it
may be the task's fault; the rules are the loss ledger's
(:mod:`fiber_core.parallel.pool.ledger`): a batch that is not watched says no item
started, so its units run again alone and *watched* (the worker names each item
as it starts); the item fails (:class:`~fiber_core.base.errors.TaskLostError`,
naming it) at once for an out-of-memory kill, after ``task_losses``
(:data:`MAX_TASK_ATTEMPTS`) deaths that may be its fault, after
:data:`~fiber_core.parallel.pool.ledger.MAX_TASK_KILLS` SIGKILLs known not to be
OOM kills. Losses that are no task's fault are bounded pool-wide by
``loss_limit``; workers that die before they are ready fail the pool after a
streak, with the exit code and the tail of the worker's log: the pool never
retries forever. A worker sent SIGTERM *drains*: it finishes its batch and hands
back the rest (:class:`_Drain`). A backend that refuses to start replacements is
retried with a backoff for :data:`START_RETRY_SECONDS`.

Batching defaults
-----------------
A *unit* is ``chunksize`` consecutive items (``chunksize`` never changes
results, only how work is grouped). When ``map``/``starmap`` get no
``chunksize``, the input is cut into ``AUTO_UNITS_PER_WORKER * processes``
units of equal size (give or take one item; one item each for short inputs):
fine enough that the last units balance well, coarse enough that per-unit costs
vanish for tiny tasks. Big pools get fewer per worker, :data:`AUTO_UNITS_MAX` in
all (but at least 4 per worker): the last units of a map travel one per message,
and with hundreds of workers those messages, not the work, set the pace. When an
earlier job timed the same function, fewer units if that leaves each
:data:`MIN_UNIT_SECONDS` of work (never fewer than 4 per worker,
multiprocessing's default). ``imap`` and ``imap_unordered`` default to
one item, as in the stdlib.

The master sends a worker as many units per message as fit in
:data:`TARGET_BATCH_SECONDS` of measured work (:data:`MAP_BATCH_SECONDS` for
``map``/``starmap``, whose results are only seen at the end), at least one, at
most :data:`MAX_BATCH_UNITS`, and no more than half a fair share of what is
queued (queue / (2 * processes)), unless that is less than
:data:`MIN_SPLIT_SECONDS` of work, too little to be worth a message of its own:
then up to a full fair share. Task times are measured per job (a ``map``, an
``apply``...); until a job's first batch is back, the same function's time per
item in an earlier job stands in, or else its messages carry one unit.

Every ready worker gets a message before any gets a second. A second message in
flight (prefetch) needs a measured or known time, and is sent for a ``map`` while
the queue holds two units per worker, otherwise only while batches are shorter
than :data:`PREFETCH_BELOW_SECONDS`, so that long tasks are never queued behind a
busy worker; and never with more than :data:`PREFETCH_MAX_BYTES`: a worker reads
its socket between batches only (no reader thread to hand messages over), so a
prefetch waits in the socket buffer. The caller's thread sends the first batches
of new work itself; after that the master sends a worker its next batch when its
results come in, looking at that worker only.

Extensions to the stdlib API: :meth:`Pool.resize` grows or shrinks a running pool;
``close()`` on an ``imap`` iterator and ``cancel()`` on a result cancel a call;
``retries=``, ``task_losses=`` and ``loss_limit=`` (see docs/guarantees.md).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import os
import queue as _queue
import select
import selectors
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import CancelledError
from typing import Any

from fiber_core.base.errors import (
    BackendError,
    DeadlineError,
    FiberError,
    JobStartError,
    TaskExitError,
    TaskLostError,
    TimeoutError,
)
from fiber_core.base.fds import OUT_OF_DESCRIPTORS, limit_error
from fiber_core.base.log import log
from fiber_core.base.memory import release_free_memory
from fiber_core.contract.jobs import EndReason
from fiber_core.parallel.pool.ledger import (
    LOSS_LIMIT,
    LOSS_WINDOW,
    MAX_TASK_ATTEMPTS,
    Fault,
    LossWindow,
    Start,
    StartStreak,
    charge,
    describe_end,
    fault_of,
    lost_message,
    running_item,
)
from fiber_core.processes.process import Process, cpu_count, start_processes
from fiber_core.runtime import status
from fiber_core.runtime.hub import dial
from fiber_core.runtime.run import runtime, sending_to
from fiber_core.wire.framing import Connection
from fiber_core.wire.messages import (
    POOL_CANCEL,
    POOL_DRAIN,
    POOL_QUIT,
    POOL_READY,
    POOL_RESULTS,
    POOL_RUNNING,
    POOL_TASKS,
    MessageError,
    decode_pool_cancel,
    decode_pool_drain,
    decode_pool_hello,
    decode_pool_results,
    decode_pool_running,
    decode_pool_tasks,
    encode_pool_cancel,
    encode_pool_drain,
    encode_pool_hello,
    encode_pool_results,
    encode_pool_running,
    encode_pool_tasks,
    kind_of,
    unexpected,
)
from fiber_core.wire.serialize import dumps, loads

TARGET_BATCH_SECONDS = 0.02


MAP_BATCH_SECONDS = 0.25


MAX_BATCH_UNITS = 1000


PREFETCH_BELOW_SECONDS = 0.05


PREFETCH_MAX_BYTES = 32 * 1024


MIN_SPLIT_SECONDS = 0.001


AUTO_UNITS_PER_WORKER = 64


AUTO_UNITS_MAX = 4096


MIN_UNIT_SECONDS = 0.001


DRAIN_GRACE_SECONDS = 25.0


CANCEL_CHECK_SECONDS = 0.005


START_RETRY_SECONDS = 300.0


BACKUP_FACTOR = 3.0


BACKUP_CHECK_SECONDS = 0.02


BACKUP_MIN_SECONDS = 0.01


START_BACKOFF_SECONDS = 0.5


START_BACKOFF_MAX_SECONDS = 15.0


IDLE_TIMEOUT = 60.0
"""Seconds a worker beyond an elastic pool's minimum may stay idle before it goes."""

UNGRANTED_BACKOFF_SECONDS = 10.0
"""After the platform declined a worker (it never started while others run), seconds
before the pool asks again."""

THROUGHPUT_SECONDS = 10
"""The live view's throughput: tasks done per second over this many seconds."""

STATUS_WAIT_SECONDS = 2.0
"""How long a snapshot for the live view waits for the master thread (then it is taken
from another thread, its counts possibly one batch apart)."""

_FUNC_CACHE = 64


_LARGE_MAP = 100_000
"""Results of a map from which the parent gives its allocator's free memory back."""


_APPLY, _MAP, _STARMAP = 0, 1, 2


_job_counter = itertools.count()


def _check_deadline(deadline: float | None) -> None:
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                 or deadline <= 0):
        raise ValueError(f"deadline must be a number of seconds over 0, or None; not {deadline!r}")


def _check_retries(retries: int) -> int:
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise ValueError(f"retries must be an int of 0 or more, not {retries!r}")
    return retries


def _call_name(method: str, func: Callable) -> str:
    """How an error names a call: ``map(f)`` (:meth:`_Unit.name` adds an item or arguments)."""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    if name is None:
        inner = getattr(func, "func", None)  # a functools.partial
        name = getattr(inner, "__qualname__", None) or type(func).__name__
    return f"{method}({name})"


def _end_of(w: _Worker) -> tuple[int | None, EndReason | None, str]:
    """A lost worker's exit code, end reason and the platform's detail, as far as known."""
    code = w.process.exitcode
    run = w.process._run
    job = run.job if run is not None else None
    if job is None or not job.state.done():
        return code, None, ""
    return code, job.state.reason, job.state.detail


def _describe_end(w: _Worker, code: int | None, reason: EndReason | None, detail: str) -> str:
    """What happened to a worker, for people (:func:`~fiber_core.parallel.pool.ledger.describe_end`)."""
    memory = w.process._resources.get("memory")
    run = w.process._run
    if run is not None and run.job is not None and run.job.spec.memory:
        memory = run.job.spec.memory
    return describe_end(w.process.name, code, reason, detail, memory)


class RemoteTraceback(Exception):
    """Carries the traceback text of an exception raised in a worker (its ``__cause__``)."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


class MaybeEncodingError(FiberError):
    """A task's result (or exception) could not be pickled in the worker."""

    def __init__(self, exc: str, value: str) -> None:
        super().__init__(exc, value)
        self.exc, self.value = exc, value

    def __str__(self) -> str:
        return f"Error sending result: '{self.value}'. Reason: '{self.exc}'"


def _rebuild_exc(exc: BaseException, tb: str) -> BaseException:
    exc.__cause__ = RemoteTraceback(f'\n"""\n{tb}"""')
    return exc


def _task_error(unit: _Unit, ok: bool | None, value: Any) -> BaseException:
    """The caller's exception for a unit that failed in its worker."""
    if ok is None:  # its arguments could not be unpickled in the worker
        message, tb = value
        err: BaseException = TaskExitError(
            f"{unit.name()}: its arguments cannot be unpickled in the worker: {message}")
        return _rebuild_exc(err, tb)
    exc, tb = value
    if isinstance(exc, SystemExit):
        err = TaskExitError(f"{unit.name()} called sys.exit({exc.code!r})")
    elif isinstance(exc, KeyboardInterrupt):
        err = TaskExitError(f"{unit.name()} was interrupted (KeyboardInterrupt in the worker)")
    else:
        return _rebuild_exc(exc, tb) if tb else exc
    err.__context__ = exc
    return _rebuild_exc(err, tb)


def _run_unit(func: Callable, kind: int, data: bytes,
              notify: Callable[[int], None] | None = None) -> tuple[bool | None, Any]:
    """Run one unit: ``(True, results)``, ``(False, (exc, tb))`` if it raised, or
    ``(None, (message, tb))`` if its arguments could not be unpickled here."""
    try:
        items = loads(data)
    except Exception as e:
        return None, (repr(e), traceback.format_exc())
    try:
        if notify is not None:  # a watched batch: the master learns which item runs
            out = []
            for i, item in enumerate(items):
                notify(i)
                if kind == _MAP:
                    out.append(func(item))
                elif kind == _STARMAP:
                    out.append(func(*item))
                else:
                    args, kwds = item
                    out.append(func(*args, **kwds))
            return True, out
        if kind == _MAP:
            return True, list(map(func, items))
        if kind == _STARMAP:
            return True, list(itertools.starmap(func, items))
        args, kwds = items[0]
        return True, [func(*args, **kwds)]
    except (Exception, SystemExit, KeyboardInterrupt) as e:
        # sys.exit() and Ctrl-C in a task are the task's result: the worker goes on.
        return False, (e, traceback.format_exc())


def _encode_results(batch_id: int, elapsed: float, results: list) -> bytes:
    try:
        return encode_pool_results(batch_id, elapsed, results)
    except Exception:
        fixed = []
        for ok, value in results:
            try:
                dumps(value)
                fixed.append((ok, value))
            except Exception as e:
                shown = value[0] if not ok else value
                err = MaybeEncodingError(repr(e), repr(shown)[:500])
                fixed.append((False, (err, "")))
        return encode_pool_results(batch_id, elapsed, fixed)


def _load_func(data: bytes) -> Callable:
    """The task's function, or one that raises why it could not be unpickled here."""
    try:
        return loads(data)
    except Exception as e:
        message = f"cannot unpickle the task's function in the worker: {e!r}"

        def unloadable(*args: Any, **kwds: Any) -> Any:
            raise FiberError(message)
        return unloadable


class _Drain:
    """A pool worker's answer to SIGTERM (a preemption notice, ``docker stop``, a pod's end).

    It tells the master which batch it still finishes (the master re-queues the
    others at once), runs nothing else, and exits when the master says so, or
    after :data:`DRAIN_GRACE_SECONDS` if the batch is not done by then (the master
    then re-queues it too, uncharged).
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()  # every frame the worker sends, and the fields below
        self.draining = False
        self.current = -1  # the batch being run
        self._asked = threading.Event()
        try:
            signal.signal(signal.SIGTERM, self._on_signal)
        except ValueError:  # not the main thread: no draining, SIGTERM ends the worker
            return
        threading.Thread(target=self._run, daemon=True, name="fiber-pool-drain").start()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._asked.set()  # only that: the handler may interrupt a send holding the lock

    def _run(self) -> None:
        self._asked.wait()
        with self.lock:
            self.draining = True
            busy = self.current >= 0
            try:
                self.conn.send_frame(encode_pool_drain(self.current))
            except OSError:
                pass
        if busy:
            time.sleep(DRAIN_GRACE_SECONDS)  # the grace period itself, not synchronisation
            os._exit(128 + signal.SIGTERM)  # the batch is not done: the master re-queues it


def _read_ahead(conn: Connection, poller: select.poll, inbox: collections.deque[bytes],
                cancelled: collections.OrderedDict[int, None]) -> None:
    """Take the frames that have arrived: cancels into ``cancelled``, the rest into ``inbox``."""
    while poller.poll(0):  # one syscall: this runs before every batch
        msg = conn.recv_bytes()
        if kind_of(msg) == POOL_CANCEL:
            cancelled[decode_pool_cancel(msg)] = None
            if len(cancelled) > _FUNC_CACHE:
                cancelled.popitem(last=False)
        else:
            inbox.append(msg)


def _out_of_descriptors(e: BaseException | None) -> OSError | None:
    """``e`` as an error naming the descriptor limit, if it (or its cause) is this process
    running out of descriptors."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in OUT_OF_DESCRIPTORS:
            return e if "out of file descriptors" in str(e) else limit_error(e)
        e = e.__cause__
    return None


def _worker_main(hub: str, pool_id: str, worker_id: int, initializer: Callable | None,
                 initargs: tuple, maxtasks: int | None) -> None:
    sock = dial(hub, runtime().authkey, f"pool:{pool_id}")
    conn = Connection(sock)
    conn.send_frame(encode_pool_hello(worker_id))
    if initializer is not None:
        initializer(*initargs)
    drain = _Drain(conn)
    conn.send_frame(POOL_READY)
    # Read in this thread: no hand-off to wake up per message. The master only sends
    # to a worker that is idle, or a prefetch small enough to wait in the socket buffer.
    funcs: collections.OrderedDict[int, Callable] = collections.OrderedDict()
    inbox: collections.deque[bytes] = collections.deque()
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    cancelled: collections.OrderedDict[int, None] = collections.OrderedDict()
    done = 0
    while maxtasks is None or done < maxtasks:
        try:
            if not inbox:
                inbox.append(conn.recv_bytes())
            _read_ahead(conn, poller, inbox, cancelled)  # a cancel may have come after this batch
        except (EOFError, OSError):
            break
        msg = inbox.popleft()
        op = kind_of(msg)
        if op == POOL_QUIT:
            break
        if op == POOL_CANCEL:
            cancelled[decode_pool_cancel(msg)] = None
            continue
        if op != POOL_TASKS:
            raise unexpected(msg, "a pool worker's connection")
        batch_id, func_id, func_bytes, kind, units, watch = decode_pool_tasks(msg)
        if func_bytes is not None:
            funcs[func_id] = _load_func(func_bytes)
            if len(funcs) > _FUNC_CACHE:
                funcs.popitem(last=False)
        with drain.lock:
            if drain.draining:
                continue  # handed back: the master has re-queued it
            if func_id in cancelled:  # not started: say so, with no results
                conn.send_frame(POOL_RESULTS, _encode_results(batch_id, 0.0, []))
                continue
            drain.current = batch_id
        func = funcs[func_id]
        notify = None
        if watch:
            def notify(item: int, batch_id: int = batch_id) -> None:
                with drain.lock:
                    conn.send_frame(encode_pool_running(batch_id, item))
        start = checked = time.perf_counter()
        results = []
        for unit in units:
            results.append(_run_unit(func, kind, unit, notify))
            now = time.perf_counter()
            if now - checked > CANCEL_CHECK_SECONDS:  # between units: was the call cancelled?
                checked = now
                try:
                    _read_ahead(conn, poller, inbox, cancelled)
                except (EOFError, OSError):
                    pass
                if func_id in cancelled:
                    break  # the master drops this call's results: the rest are not started
        done += len(units)
        elapsed = time.perf_counter() - start
        payload = _encode_results(batch_id, elapsed, results)
        with drain.lock:
            conn.send_frame(POOL_RESULTS, payload)
            drain.current = -1
    conn.close()


class ApplyResult:
    """The result of ``apply_async``; the base of the other result types."""

    def __init__(self, pool: Pool, callback: Callable | None, error_callback: Callable | None) -> None:
        self._pool = pool
        self._event = threading.Event()
        self._callback = callback
        self._error_callback = error_callback
        self._success = False
        self._value: Any = None
        self._job_id = next(_job_counter)
        self._call = "apply_async"  # how errors name the call

    def ready(self) -> bool:
        return self._event.is_set()

    def successful(self) -> bool:
        if not self.ready():
            raise ValueError(f"{self!r} not ready")
        return self._success

    def wait(self, timeout: float | None = None) -> None:
        self._event.wait(timeout)

    def get(self, timeout: float | None = None) -> Any:
        self.wait(timeout)
        if not self.ready():
            raise TimeoutError
        if self._success:
            return self._value
        raise self._value

    def cancel(self) -> bool:
        """Cancel the call's tasks not started yet and stop waiting for running ones (Fiber extension).

        Returns ``False`` if the result was ready already; else ``get()`` then raises
        :class:`concurrent.futures.CancelledError` (no callback is called) and the
        pool no longer counts the call as outstanding.
        """
        if self._event.is_set():
            return False
        self._pool._cancel(self)
        with self._pool._lock:
            if self._event.is_set():
                return False
            self._success, self._value = False, CancelledError()
            self._event.set()
        return True

    def cancelled(self) -> bool:
        return self._event.is_set() and isinstance(self._value, CancelledError)

    def _expire(self, seconds: float) -> None:
        """The deadline passed (master thread, lock held, the call already cancelled)."""
        self._finish(False, DeadlineError(f"{self._call}: its deadline of {seconds:g} s passed "
                                          "before it finished; it was cancelled", [None], 0, 1))

    # Called by the master thread.
    def _set_unit(self, unit: int, ok: bool, values: Any) -> None:
        self._finish(ok, values[0] if ok else values)

    def _finish(self, ok: bool, value: Any) -> None:
        if self._event.is_set():
            return
        self._success, self._value = ok, value
        cb = self._callback if ok else self._error_callback
        if cb is not None:
            try:
                cb(value)
            except Exception:
                log.exception("fiber: pool callback raised")
        self._event.set()
        self._pool._job_done(self)

    def _fail(self, exc: BaseException) -> None:
        self._finish(False, exc)


AsyncResult = ApplyResult


class MapResult(ApplyResult):
    """The result of ``map_async``/``starmap_async``: a list in input order."""

    def __init__(self, pool: Pool, nunits: int,
                 callback: Callable | None, error_callback: Callable | None) -> None:
        super().__init__(pool, callback, error_callback)
        self._chunks: list[Any] = [None] * nunits
        self._sizes: list[int] = []  # items per unit, for a partial result at a deadline
        self._left = nunits
        if nunits == 0:
            self._success, self._value = True, []
            self._event.set()

    def _expire(self, seconds: float) -> None:
        results: list = []
        done = 0
        for chunk, size in zip(self._chunks, self._sizes):
            if chunk is None:
                results.extend([None] * size)
            else:
                results.extend(chunk)
                done += size
        self._finish(False, DeadlineError(
            f"{self._call}: its deadline of {seconds:g} s passed with {done} of {len(results)} "
            f"tasks finished; the others were cancelled (their results are None in .results)",
            results, done, len(results)))

    def _set_unit(self, unit: int, ok: bool, values: Any) -> None:
        if self._event.is_set():
            return
        if not ok:
            self._finish(False, values)
            return
        self._chunks[unit] = values
        self._left -= 1
        if self._left == 0:
            chunks, self._chunks = self._chunks, []
            # One list of the final size, each unit's values moved in and let go at once:
            # no list regrown step by step, no second full copy held at the peak.
            out: list = [None] * sum(map(len, chunks))
            at = 0
            for i, values in enumerate(chunks):
                out[at:at + len(values)] = values
                at += len(values)
                chunks[i] = None
            del chunks, values
            if len(out) >= _LARGE_MAP:
                release_free_memory()  # what the map's transient buffers took goes back
            self._finish(True, out)


class IMapIterator:
    """The iterator ``imap`` returns: results in input order, as they arrive."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._cond = threading.Condition(threading.Lock())
        self._items: collections.deque = collections.deque()
        self._ready: dict[int, tuple[bool, Any]] = {}
        self._next_unit = 0
        self._length: int | None = None  # units, known once the input is consumed
        self._yielded_units = 0
        self._job_id = next(_job_counter)
        self._call = "imap"  # how errors name the call
        self._closed = False

    def __iter__(self) -> Iterator:
        return self

    def close(self) -> None:
        """Stop the call, as closing a generator does (Fiber extension).

        Its tasks not started yet never start, running ones are not waited for,
        and the input is read no further: ``islice(it, k)`` then ``close()`` takes
        the first k results of n. ``next()`` raises :class:`StopIteration` after.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._items.clear()
            self._ready.clear()
            self._length = self._yielded_units = max(self._yielded_units, self._length or 0)
            self._cond.notify_all()
        self._pool._cancel(self)

    def __enter__(self) -> IMapIterator:
        return self

    def _expire(self, seconds: float) -> None:
        self._fail(DeadlineError(
            f"{self._call}: its deadline of {seconds:g} s passed; the results before this "
            f"error are what finished, the other tasks were cancelled"))
        with self._cond:
            self._closed = True  # results that come later are dropped

    def __exit__(self, *exc: object) -> None:
        self.close()

    def next(self, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._items:
                    ok, value = self._items.popleft()
                    if ok:
                        return value
                    raise value
                if self._length is not None and self._yielded_units >= self._length:
                    raise StopIteration
                # Woken without news (a unit that came out of order): wait the rest only.
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and (left <= 0 or not self._cond.wait(left)):
                    raise TimeoutError
                if left is None:
                    self._cond.wait()

    __next__ = next

    def _push(self, ok: bool, values: Any) -> None:
        self._yielded_units += 1
        if ok:
            self._items.extend((True, v) for v in values)
        else:
            self._items.append((False, values))

    def _set_unit(self, unit: int, ok: bool, values: Any) -> None:
        with self._cond:
            if self._closed:
                return
            self._ready[unit] = (ok, values)
            while self._next_unit in self._ready:
                self._push(*self._ready.pop(self._next_unit))
                self._next_unit += 1
            self._cond.notify_all()
            self._maybe_done()

    def _set_length(self, nunits: int) -> None:
        with self._cond:
            if self._closed:
                return
            self._length = nunits
            self._cond.notify_all()
            self._maybe_done()

    def _maybe_done(self) -> None:
        if self._length is not None and self._yielded_units >= self._length:
            self._pool._job_done(self)

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            self._items.append((False, exc))
            self._length = self._yielded_units + 1 if self._length is None else self._length
            self._yielded_units = self._length
            self._cond.notify_all()
        self._pool._job_done(self)


class IMapUnorderedIterator(IMapIterator):
    """The iterator ``imap_unordered`` returns: results as they complete."""

    def _set_unit(self, unit: int, ok: bool, values: Any) -> None:
        with self._cond:
            if self._closed:
                return
            self._push(ok, values)
            self._cond.notify_all()
            self._maybe_done()


class _Unit:
    __slots__ = ("job", "index", "data", "charges", "func_id", "func_bytes", "kind", "count",
                 "start", "watch", "retries", "done", "copies")

    def __init__(self, job: Any, index: int, data: bytes, func_id: int, func_bytes: bytes,
                 kind: int, count: int = 1, start: int = 0, retries: int = 0) -> None:
        self.job, self.index, self.data = job, index, data
        self.func_id, self.func_bytes, self.kind = func_id, func_bytes, kind
        self.count = count  # items in the unit
        self.start = start  # the input position of its first item
        self.charges: dict[tuple[int, Fault], int] | None = None  # deaths charged, per item and kind
        self.watch = False  # a worker died while it may have run: it runs alone, watched
        self.retries = retries  # runs left after it raised (an opt-in)
        self.done = False  # its result was delivered: another copy's is dropped
        self.copies = 0  # workers that hold it (two while a backup copy runs)
        # (done and copies are kept only in a pool with backup tasks: elsewhere a unit is
        # never in two places, and the pool's hot path does not pay for them)

    def name(self, item: int | None = None) -> str:
        """The task, as an error names it: ``item 17 of map(f)``, ``apply_async(f, (3,))``."""
        call = getattr(self.job, "_call", "a task")
        if type(self.job) is ApplyResult:
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


class _StatusAsk:
    """A snapshot asked of the master thread: it fills ``state`` and sets ``ready``."""

    __slots__ = ("ready", "state")

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.state: dict[str, Any] | None = None


def _worker_state(w: _Worker) -> str:
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


def _call_progress(job: Any) -> dict[str, Any]:
    """One call of the pool as the live view shows it: its name and units done of how many."""
    if isinstance(job, MapResult):
        total: int | None = len(job._chunks)
        done = (total or 0) - job._left
    elif isinstance(job, IMapIterator):
        total = job._length
        done = job._yielded_units + len(job._ready)
    else:
        total, done = 1, int(job.ready())
    return {"call": job._call, "units_done": done, "units": total}


class _Worker:
    def __init__(self, wid: int, process: Process) -> None:
        self.id = wid
        self.process = process
        self.conn: Connection | None = None
        self.ready = False
        self.lost = False
        self.retiring = False
        self.pending: dict[int, list[_Unit]] = {}
        self.assigned = 0
        self.running: tuple[int, int] | None = None  # (batch, item) a watched batch runs
        self.culprit: tuple[_Unit, int] | None = None  # the item it ran when it died
        self.draining = False  # it was told to stop (SIGTERM) and hands its work back
        self.sent: dict[int, float] = {}  # when each pending batch was sent (for backups)
        self.held_work = False  # it held batches when it was lost
        self.funcs: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.last_work = time.monotonic()  # when it was last given work or answered
        self.since = self.last_work  # when its state (as the live view shows it) last changed
        self.done = 0  # tasks (items) whose results it delivered


class Pool:
    """A pool of job-backed workers with the API of :class:`multiprocessing.pool.Pool`.

    Fiber adds keyword-only arguments: ``backend`` (a backend for the workers),
    resources ``cpu``, ``memory`` (MiB), ``gpu``, ``gpu_type`` and ``image``
    for each worker's job (defaulting to what :func:`fiber_core.meta` put on the
    ``initializer``, then to configuration), and :meth:`resize`. How lost workers
    are charged: ``retries`` (runs again of a task that raised; default 0, also per
    call), ``task_losses`` (worker deaths a task may cause before it fails; an
    out-of-memory kill fails it at once), ``loss_limit`` (``(losses, seconds)``: workers
    lost to no task's fault before the pool fails; default ``(max(100, 10 *
    processes), 600)``).

    **Elastic pools.** With ``min_processes`` below ``processes``, the pool keeps at
    least ``min_processes`` workers and asks for more, up to ``processes``, while work
    waits in its queue; a worker beyond the minimum that stays idle for
    ``idle_timeout`` seconds (default 60) goes. A worker asked for is a request: one
    the platform has not granted yet (a pending pod, a RUNNABLE Batch job) takes no
    work until it runs, and tasks never wait for the pool to reach any size. A worker
    that the platform never starts (``NEVER_STARTED``) while others run is a request
    declined, not a failure: the pool asks again later. ``Pool(64, min_processes=4)``
    reads "up to 64 workers, at least 4"; ``min_processes=0`` keeps none while idle.
    """

    def __init__(self, processes: int | None = None, initializer: Callable | None = None,
                 initargs: tuple = (), maxtasksperchild: int | None = None, context: Any = None,
                 *, backend: str | None = None, retries: int = 0,
                 task_losses: int = MAX_TASK_ATTEMPTS,
                 loss_limit: tuple[int, float] | None = None, backup: bool | float = False,
                 min_processes: int | None = None, idle_timeout: float = IDLE_TIMEOUT,
                 **resources: Any) -> None:

        if processes is None:
            processes = cpu_count()
        if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
            raise ValueError("Number of processes must be at least 1")
        if min_processes is None:
            min_processes = processes
        if (not isinstance(min_processes, int) or isinstance(min_processes, bool)
                or not 0 <= min_processes <= processes):
            raise ValueError(f"min_processes must be an int from 0 to processes ({processes}), "
                             f"not {min_processes!r}")
        if isinstance(idle_timeout, bool) or not isinstance(idle_timeout, (int, float)) or not idle_timeout > 0:
            raise ValueError(f"idle_timeout must be a number of seconds above 0, not {idle_timeout!r}")
        self._min = min_processes
        self._idle_timeout = float(idle_timeout)
        self._idle_check_at = 0.0
        if maxtasksperchild is not None and (
                not isinstance(maxtasksperchild, int) or maxtasksperchild <= 0):
            raise ValueError("maxtasksperchild must be a positive int or None")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        self._retries = _check_retries(retries)
        if not isinstance(task_losses, int) or isinstance(task_losses, bool) or task_losses < 1:
            raise ValueError(f"task_losses must be an int of 1 or more, not {task_losses!r}")
        self._task_losses = task_losses
        if loss_limit is not None:
            try:
                count, window = loss_limit
                ok = isinstance(count, int) and count >= 1 and float(window) > 0
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"loss_limit must be (losses, seconds), such as (100, 600.0); "
                                 f"not {loss_limit!r}")
        self._loss_limit = loss_limit
        if backup is True:
            backup = BACKUP_FACTOR
        if backup is False or backup is None:
            self._backup: float | None = None
        elif isinstance(backup, (int, float)) and backup > 1:
            self._backup = float(backup)
        else:
            raise ValueError(f"backup must be True, False or a factor over 1 (such as 3.0), not {backup!r}")
        self._losses = LossWindow(LOSS_LIMIT, LOSS_WINDOW)  # workers lost to nobody's fault
        self._deadlines: list[tuple[float, int, float, Any]] = []  # heap of (when, job id, s, job)
        self._started = False  # the first workers started: later start errors are retried
        self._start_retry_at: float | None = None  # starts are refused: the next try
        self._start_failing_since: float | None = None
        self._start_backoff = START_BACKOFF_SECONDS
        self._initializer = initializer
        self._initargs = tuple(initargs)
        self._maxtasks = maxtasksperchild
        self._backend = backend
        meta = getattr(initializer, "__fiber_meta__", None) or {}
        self._resources = {k: v for k, v in {**meta, **resources}.items() if v is not None}
        self._processes = processes
        self._id = os.urandom(16).hex()
        self._lock = threading.RLock()  # callbacks may call back into the pool
        self._queue: collections.deque[_Unit] = collections.deque()
        self._workers: dict[int, _Worker] = {}
        self._wid = itertools.count(1)
        self._jobs: dict[int, Any] = {}
        self._state = "RUN"
        self._error: BaseException | None = None
        self._streak = StartStreak()  # workers in a row that died before they were ready
        self._unit_seconds: dict[int, float] = {}  # per job: running mean of one unit's time
        # per pickled function: the last job's mean time per item, to size a new job's first batches
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
        self._done_per_second: collections.deque[list[int]] = collections.deque(
            maxlen=THROUGHPUT_SECONDS + 2)  # [monotonic second, tasks done in it]
        self._losses_by: collections.Counter[str] = collections.Counter()  # EndReason value
        self._last_loss = ""
        self._status_asks: list[_StatusAsk] = []
        hub = runtime().hub
        # What the workers' backend reaches this process at (also put in pickled queues).
        workers_backend = runtime().get_backend(backend)
        self._backend_name = workers_backend.name
        self._hub = runtime().addresses_for(workers_backend)
        # Workers that start on this machine's CPUs start a few at a time (see _top_up).
        self._burst = cpu_count() if workers_backend.shares_this_machine else None
        hub.register(f"pool:{self._id}", self._on_connect)
        try:
            with self._lock:
                self._top_up()
                self._started = True
        except BaseException:
            self._state = "TERMINATE"
            for w in self._workers.values():
                w.process.kill()
            hub.unregister(f"pool:{self._id}")
            raise
        self._thread = threading.Thread(target=self._master, daemon=True, name="fiber-pool-master")
        self._thread.start()
        status.report(self)

    # -- workers ---------------------------------------------------------------------

    def _start_workers(self, n: int) -> None:
        """Start ``n`` workers with one group start of the backend (``Backend.start_jobs``)."""
        made = []
        for _ in range(n):
            wid = next(self._wid)
            made.append((wid, Process(
                target=_worker_main, name=f"PoolWorker-{wid}", daemon=True, backend=self._backend,
                args=(self._hub, self._id, wid, self._initializer, self._initargs, self._maxtasks),
                **self._resources)))
        start_processes([p for _, p in made])
        for wid, p in made:
            w = _Worker(wid, p)
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

    # -- master loop -------------------------------------------------------------------

    def _master(self) -> None:
        try:
            while True:
                # A result or a ready message gives room to its worker only: dispatching to
                # it alone keeps a message's cost independent of the pool's size. Anything
                # else (new work, re-queued work, a resize, a quiet second) looks at all.
                timeout = BACKUP_CHECK_SECONDS if self._backup is not None and self._jobs else 1.0
                if self._deadlines:
                    with self._lock:
                        left = self._expire_deadlines()
                    if left is not None:
                        timeout = min(timeout, left)
                events = self._sel.select(timeout)
                touched: list[_Worker] | None = [] if events else None
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
                if self._requeued:
                    self._requeued = False
                    touched = None
                while not self._incoming.empty():
                    self._adopt(*self._incoming.get())
                with self._lock:
                    if self._status_asks:
                        self._answer_status()
                    if self._state == "TERMINATE":
                        break
                    if self._start_retry_at is not None and time.monotonic() >= self._start_retry_at:
                        self._top_up()
                    self._dispatch(touched)
                    if self._state == "RUN" or self._queue:
                        self._grow()
                        self._shrink_idle()
                    if self._backup is not None and not self._queue:
                        self._start_backups()
                    if self._state == "CLOSE" and not self._jobs and not self._queue:
                        self._retire_all()
                        if not self._workers:
                            break
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

    def _adopt(self, wid: int, sock: socket.socket) -> None:
        w = self._workers.get(wid)
        if w is None or w.lost or w.conn is not None:
            sock.close()
            return
        w.conn = Connection(sock)
        w.since = time.monotonic()
        self._watch(sock, ("conn", w))
        if w.retiring:
            try:
                w.conn.send_frame(POOL_QUIT)
            except OSError:
                pass

    def _on_message(self, w: _Worker) -> None:
        assert w.conn is not None
        try:
            msg = w.conn.recv_bytes()
        except (EOFError, OSError):
            self._lose(w)
            return
        op = kind_of(msg)
        if op == POOL_RESULTS:
            try:
                batch_id, elapsed, results = decode_pool_results(msg)
            except Exception as e:
                # Pickled in the worker but cannot be rebuilt here. A worker answers its
                # batches in order, so this answers its oldest pending one.
                err = FiberError(f"cannot unpickle a result sent by {w.process.name}: {e!r}")
                for unit in w.pending.pop(next(iter(w.pending))):
                    if self._backup is not None:
                        unit.copies -= 1
                        unit.done = True
                    unit.job._set_unit(unit.index, False, err)
                    self._tasks_done += unit.count
                    self._tasks_failed += unit.count
                self._retire_if_done(w)
                return
            units = w.pending.pop(batch_id)
            w.last_work = now = time.monotonic()
            if not w.pending:
                w.since = now
            if w.sent:
                w.sent.pop(batch_id, None)
            job_id = units[0].func_id
            backup = self._backup is not None
            if not results:  # skipped: its job was cancelled
                for unit in units if backup else ():
                    unit.copies -= 1
                self._retire_if_done(w)
                return
            if job_id in self._jobs:
                per_unit = elapsed / len(units)
                est = self._unit_seconds.get(job_id)
                self._unit_seconds[job_id] = per_unit if est is None else 0.8 * est + 0.2 * per_unit
                key = hash(units[0].func_bytes)
                self._item_seconds[key] = elapsed / max(1, sum(u.count for u in units))
                self._item_seconds.move_to_end(key)
                if len(self._item_seconds) > _FUNC_CACHE:
                    self._item_seconds.popitem(last=False)
            w.running = None
            done = 0
            for unit, (ok, value) in zip(units, results):
                if backup:
                    unit.copies -= 1
                    if unit.done:
                        continue  # a backup copy's result came first
                if not ok:
                    if unit.retries > 0:  # the caller opted in: run it again
                        unit.retries -= 1
                        self._requeue([unit])
                        continue
                    value = _task_error(unit, ok, value)
                    ok = False
                    self._tasks_failed += unit.count
                if backup:
                    unit.done = True
                unit.job._set_unit(unit.index, ok, value)
                done += unit.count
            if done:  # the live view's counters: a few operations per batch
                w.done += done
                self._tasks_done += done
                second = int(now)
                per_second = self._done_per_second
                if per_second and per_second[-1][0] == second:
                    per_second[-1][1] += done
                else:
                    per_second.append([second, done])
            self._retire_if_done(w)
        elif op == POOL_RUNNING:
            w.running = decode_pool_running(msg)
        elif op == POOL_DRAIN:
            self._on_drain(w, decode_pool_drain(msg))
        elif op == POOL_READY:
            w.ready = True
            w.since = time.monotonic()
            self._streak.ready()
            with self._lock:
                if self._state == "RUN" or self._queue:
                    self._top_up()
        else:
            # Not a message of this pool: the worker is cut off (it exits) and its tasks
            # go to the others.
            log.error("fiber: %s", unexpected(msg, f"the connection of {w.process.name}"))
            self._lose(w)

    def _on_drain(self, w: _Worker, keep: int) -> None:
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

    def _retire_if_done(self, w: _Worker) -> None:
        if w.retiring and not w.pending and w.conn is not None:
            try:
                w.conn.send_frame(POOL_QUIT)
            except OSError:
                pass

    def _lose(self, w: _Worker) -> None:
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
            if w.conn._sock is not None:
                try:
                    self._sel.unregister(w.conn._sock)
                except (KeyError, ValueError):
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
            self._requeue([u for _, units in batches for u in units])

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

    def _on_exit(self, w: _Worker) -> None:
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
        code, reason, detail = _end_of(w)
        culprit, w.culprit = w.culprit, None
        if culprit is not None and culprit[0].done:
            culprit = None  # a backup copy delivered it
        with self._lock:
            self._workers.pop(w.id, None)
            if self._state == "TERMINATE":
                return
            what = _describe_end(w, code, reason, detail)
            fault = fault_of(code, reason, w.draining)
            if culprit is not None:
                self._charge(culprit[0], culprit[1], fault, what)
            if w.retiring and not w.draining and culprit is None:
                return
            if not (code == 0 and self._maxtasks is not None and w.assigned >= self._maxtasks):
                # (a worker that did its maxtasksperchild and left is replaced, not lost)
                self._losses_by[reason.value if reason is not None else "unknown"] += 1
                self._last_loss = what
            if self._state == "CLOSE" and not self._queue and not self._jobs:
                return  # closing, and nothing is left to do
            if not self._after_loss(w, code, reason, fault, culprit is not None, what):
                self._top_up()

    def _charge(self, unit: _Unit, item: int, fault: Fault, what: str) -> None:
        """The worker died while ``item`` of ``unit`` ran: charge it, then run it again or fail it."""
        if fault is Fault.NONE:
            self._requeue([unit])
            return
        if unit.charges is None:
            unit.charges = {}
        count, fails = charge(unit.charges, item, fault, self._task_losses)
        if fails:
            unit.job._set_unit(unit.index, False, TaskLostError(lost_message(unit.name(item), count, fault, what)))
            self._tasks_done += unit.count
            self._tasks_failed += unit.count
        else:
            log.warning("fiber: %s while running %s; it runs again", what, unit.name(item))
            self._requeue([unit])

    def _after_loss(self, w: _Worker, code: int | None, reason: EndReason | None, fault: Fault,
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

    def _start_death(self, w: _Worker, code: int | None, reason: EndReason | None, what: str) -> bool:
        """A worker died before it was ready: True when that failed the pool (lock held)."""
        verdict = self._streak.died(code, reason, connected=w.conn is not None)
        if verdict is Start.OUTSIDE:
            return self._count_loss(what + ", while starting")
        if verdict is Start.AGAIN:
            return False
        run = w.process._run
        tail = run.log_tail() if run else ""
        self._fail_pool(JobStartError(
            f"pool workers die before they are ready ({self._streak.length} in a row); the last, {what}"
            + (f"; the end of its log:\n{tail}" if tail else ""),
            exitcode=code, logs=run.logs if run else ""))
        return True

    def _top_up(self) -> None:
        """Start workers until the pool has its size, in one group start; called with the lock held.

        On a backend whose jobs share this machine's CPUs, at most one worker per
        CPU is starting at any time: the rest start as those become ready, so the
        first result comes after one start, not after all of them shared the CPUs.

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
        if self._burst is not None:
            n = min(n, self._burst - starting)
        if n <= 0:
            return
        try:
            self._start_workers(n)
        except Exception as e:
            if not self._started:
                raise
            limit = _out_of_descriptors(e)
            self._start_failed(limit or e, retry=not isinstance(e, RuntimeError) and limit is None)
            return
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

    def _retire(self, w: _Worker) -> None:
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

    def _dispatch(self, only: list[_Worker] | None = None) -> None:
        """Hand batches to ready workers (all, or ``only``) that have room. Called with the lock held."""
        if not self._queue:
            return
        ready = [w for w in (self._workers.values() if only is None else only)
                 if w.conn is not None and not w.lost and not w.retiring and w.ready]
        if not ready:
            return
        # A fair share counts the workers still starting too: they will want work soon.
        sharers = 2 * max(len(ready), self._processes)
        # Breadth first: every idle worker gets a batch before any gets a second.
        for level in (0, 1):
            for w in ready:
                if not self._queue:
                    return
                if len(w.pending) != level:
                    continue
                front = self._queue[0]
                est, measured = self._estimate(front)
                if est is None:
                    if level:
                        continue
                    size = 1
                else:
                    # A hint from an earlier job may be far off: no batch of more than half
                    # a fair share (so two in flight: one share), until this job's own
                    # times are known.
                    est = max(est, 1e-7)
                    share = len(self._queue) // sharers
                    if measured:
                        # Not worth a message below MIN_SPLIT_SECONDS of work: then up to a
                        # full fair share (more would leave others idle).
                        share = max(share, min(int(MIN_SPLIT_SECONDS / est),
                                               2 * len(self._queue) // sharers))
                    # map's results are only seen at the end: bigger batches, fewer messages,
                    # and a prefetch as long as every worker can still get two batches.
                    is_map = type(front.job) is MapResult
                    target = MAP_BATCH_SECONDS if is_map else TARGET_BATCH_SECONDS
                    size = max(1, min(int(target / est), MAX_BATCH_UNITS, share))
                    if level and (self._prefetch_too_big(w, front) or self._running_long(w) or (
                            len(self._queue) < sharers if is_map
                            else est * size >= PREFETCH_BELOW_SECONDS)):
                        continue
                if self._maxtasks is not None:
                    room = self._maxtasks - w.assigned
                    if room <= 0:
                        continue
                    size = min(size, room)
                self._send_batch(w, size, PREFETCH_MAX_BYTES if level else None)

    def _start_backups(self) -> None:
        """Idle workers and nothing queued: run again the batches that take far too long.

        A batch is late when it has run ``backup`` times as long as its job's
        measured time for that many units. Its copy goes to an idle worker; the
        first result is delivered, the other dropped. Called with the lock held.
        """
        idle = [w for w in self._workers.values()
                if w.conn is not None and w.ready and not w.lost and not w.retiring and not w.pending]
        if not idle:
            return
        now = time.monotonic()
        late: list[tuple[float, _Worker, int]] = []
        assert self._backup is not None
        for w in self._workers.values():
            for batch_id, units in w.pending.items():
                est = self._unit_seconds.get(units[0].func_id)
                if est is None or units[0].watch or any(u.copies > 1 or u.done for u in units):
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

    def _estimate(self, unit: _Unit) -> tuple[float | None, bool]:
        """Seconds ``unit`` should take, and whether its job measured that: until the job's
        first batch is back, the same function's time per item in an earlier job stands in
        (None if there is none)."""
        est = self._unit_seconds.get(unit.func_id)
        if est is not None:
            return est, True
        per_item = self._item_seconds.get(hash(unit.func_bytes))
        return (None if per_item is None else per_item * unit.count), False

    def _running_long(self, w: _Worker) -> bool:
        """Whether the batch a worker runs may take long (its time unknown, or more than
        PREFETCH_BELOW_SECONDS): work sent behind it would wait there while another worker,
        one that becomes ready meanwhile, could run it."""
        units = next(iter(w.pending.values()), None)
        if not units:
            return False
        est = self._estimate(units[0])[0]
        return est is None or est * len(units) >= PREFETCH_BELOW_SECONDS

    def _prefetch_too_big(self, w: _Worker, front: _Unit) -> bool:
        """A prefetch waits in the socket until the worker is done: it must fit there."""
        size = len(front.data)
        if front.func_id not in w.funcs:
            size += len(front.func_bytes)
        return size > PREFETCH_MAX_BYTES

    def _send_batch(self, w: _Worker, n: int, max_bytes: int | None = None) -> None:
        units: list[_Unit] = []
        first = self._queue[0]
        nbytes = 0
        while self._queue and len(units) < n:
            u = self._queue[0]
            if u.func_id != first.func_id:
                break
            if units and (u.watch or first.watch):
                break  # a unit that may have killed its worker goes alone, watched
            nbytes += len(u.data)
            if units and max_bytes is not None and nbytes > max_bytes:
                break
            units.append(self._queue.popleft())
        self._send_units(w, units)

    def _send_units(self, w: _Worker, units: list[_Unit]) -> None:
        first = units[0]
        batch_id = next(_job_counter)
        if self._backup is not None:
            for u in units:
                u.copies += 1
            w.sent[batch_id] = time.monotonic()
        send_func = first.func_id not in w.funcs
        if send_func:
            # A finished job's function is not sent again: no entry outlives its map (each
            # would hold on to a block of memory that the map's objects had filled).
            for fid in [f for f in w.funcs if f not in self._jobs]:
                del w.funcs[fid]
            w.funcs[first.func_id] = None
            if len(w.funcs) > _FUNC_CACHE:
                w.funcs.popitem(last=False)
        payload = encode_pool_tasks(batch_id, first.func_id, first.func_bytes if send_func else None,
                                    first.kind, [u.data for u in units], first.watch)
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
                # A worker that has not connected yet is told to quit when it does.

    def _kill_workers(self) -> None:
        for w in list(self._workers.values()):
            w.retiring = True
            w.process.kill()

    def _fail_all_locked(self, exc: BaseException) -> None:
        self._queue.clear()
        for job in list(self._jobs.values()):
            job._fail(exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            self._fail_all_locked(exc)

    def _requeue(self, units: list[_Unit]) -> None:
        """Put units back at the front of the queue, in their order (those of live calls)."""
        with self._lock:
            live = [u for u in units if u.job._job_id in self._jobs and not u.done and not u.copies]
            if live:
                self._queue.extendleft(reversed(live))
                self._requeued = True

    def _cancel(self, job: Any) -> None:
        """Drop a call's queued tasks; tell the workers that hold some to skip them."""
        with self._lock:
            if self._jobs.pop(job._job_id, None) is None:
                return
            self._unit_seconds.pop(job._job_id, None)
            if any(u.job is job for u in self._queue):
                self._queue = collections.deque(u for u in self._queue if u.job is not job)
            for w in self._workers.values():
                if w.conn is None or w.lost:
                    continue
                if any(units[0].job is job for units in w.pending.values()):
                    try:
                        w.conn.send_frame(encode_pool_cancel(job._job_id))
                    except OSError:
                        pass
        self._wake()

    def _job_done(self, job: Any) -> None:
        self._jobs.pop(job._job_id, None)
        self._unit_seconds.pop(job._job_id, None)

    # -- the live view ---------------------------------------------------------------------

    def _snapshot(self) -> dict[str, Any]:
        """The pool's state for the live view (:mod:`fiber_core.runtime.status`).

        Taken by the master thread between two rounds, under the pool lock, so that its
        counts add up: every task of a call is queued, running or done. Waits at most
        :data:`STATUS_WAIT_SECONDS` for the master (busy in a callback, say); then, or once
        the master has ended, it is taken here under the lock.
        """
        if threading.current_thread() is not self._thread:
            ask = _StatusAsk()
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

    def _answer_status(self) -> None:
        """Answer the snapshots asked for (lock held)."""
        asks, self._status_asks = self._status_asks, []
        if asks:
            state = self._snapshot_locked()
            for ask in asks:
                ask.state = state
                ask.ready.set()

    def _snapshot_locked(self) -> dict[str, Any]:
        now = time.monotonic()
        queued = sum(u.count for u in self._queue)
        running = 0
        seen: set[int] = set()  # a unit that a backup copy runs too is counted once
        workers = []
        for w in list(self._workers.values()):
            units = [u for batch in list(w.pending.values()) for u in batch]
            if w.culprit is not None:  # lost while it ran this one: its exit decides
                units.append(w.culprit[0])
            in_flight = 0
            for u in units:
                in_flight += u.count
                if id(u) not in seen:
                    seen.add(id(u))
                    running += u.count
            job = w.process.job
            workers.append({
                "name": w.process.name,
                "id": job.id if job is not None else None,
                "backend": self._backend_name,
                "host": job.host if job is not None else None,
                "state": _worker_state(w),
                "for_seconds": round(now - w.since, 3),
                "done": w.done,
                "in_flight": in_flight,
            })
        window_start = max(self._created, now - THROUGHPUT_SECONDS)
        recent = sum(n for second, n in self._done_per_second if second >= int(window_start))
        span = now - window_start
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
            "throughput": round(recent / span, 3) if span > 0 else 0.0,
            "throughput_seconds": THROUGHPUT_SECONDS,
            "losses": dict(self._losses_by),
            "last_loss": self._last_loss,
            "calls": [_call_progress(job) for job in list(self._jobs.values())],
            "workers": workers,
        }

    # -- submitting work ------------------------------------------------------------------

    def _check_running(self) -> None:
        if self._error is not None:
            raise self._error
        if self._state != "RUN":
            raise ValueError("Pool not running")

    def _submit(self, job: Any, func: Callable, kind: int, chunks: Iterable[Sequence[Any]],
                func_bytes: bytes | None = None, retries: int | None = None) -> int:
        """Pickle every unit now (so a bad argument fails here), then queue them."""
        chunks = list(chunks)
        retries = self._retries if retries is None else _check_retries(retries)
        with sending_to(self._hub):
            if func_bytes is None:
                func_bytes = dumps(func)
            units = []
            start = 0
            for i, (chunk, data) in enumerate(zip(chunks, map(dumps, chunks))):
                units.append(_Unit(job, i, data, job._job_id, func_bytes, kind, len(chunk),
                                   start, retries))
                start += len(chunk)
        with self._lock:
            self._check_running()
            self._jobs[job._job_id] = job
            self._queue.extend(units)
            # Hand out the first batches from this thread: one wake-up less on the way.
            try:
                self._dispatch()
            except Exception:
                log.exception("fiber: dispatching from the caller failed; the master will")
            left = bool(self._queue)
        if left:
            self._wake()
        return len(units)

    def apply_async(self, func: Callable, args: tuple = (), kwds: dict | None = None,
                    callback: Callable | None = None, error_callback: Callable | None = None,
                    *, retries: int | None = None, deadline: float | None = None) -> ApplyResult:
        self._check_running()
        _check_deadline(deadline)
        result = ApplyResult(self, callback, error_callback)
        result._call = _call_name("apply_async", func)  # the arguments: from the unit, if needed
        self._submit(result, func, _APPLY, [[(tuple(args), dict(kwds or {}))]], retries=retries)
        self._set_deadline(result, deadline)
        return result

    def apply(self, func: Callable, args: tuple = (), kwds: dict | None = None,
              *, retries: int | None = None, deadline: float | None = None) -> Any:
        return self.apply_async(func, args, kwds, retries=retries, deadline=deadline).get()

    def _map_async(self, func: Callable, iterable: Iterable, kind: int, chunksize: int | None,
                   callback: Callable | None, error_callback: Callable | None,
                   retries: int | None = None, deadline: float | None = None) -> MapResult:
        self._check_running()
        _check_deadline(deadline)
        # A sequence is sliced as it is (a range into ranges): no copy of its items here.
        items = iterable if isinstance(iterable, (list, tuple, range)) else list(iterable)
        with sending_to(self._hub):
            func_bytes = dumps(func)
        if chunksize is None:
            # Units fine enough to balance, coarse enough to be cheap: as many as
            # AUTO_UNITS_PER_WORKER per worker (AUTO_UNITS_MAX in all for big pools, at least
            # 4 per worker), their sizes differing by one item at most;
            # fewer if this function's tasks are known to be tiny, so that a unit holds
            # MIN_UNIT_SECONDS of work, but never fewer than multiprocessing's 4 per worker.
            nunits = min(AUTO_UNITS_PER_WORKER * self._processes, max(4 * self._processes, AUTO_UNITS_MAX))
            per_item = self._item_seconds.get(hash(func_bytes))
            if per_item is not None:
                nunits = min(nunits, max(4 * self._processes,
                                         int(per_item * len(items) / MIN_UNIT_SECONDS)))
            nunits = min(len(items), nunits)
            q, r = divmod(len(items), nunits or 1)
            bounds = [i * q + min(i, r) for i in range(nunits + 1)]
            chunks = [items[a:b] for a, b in zip(bounds, bounds[1:])]
        elif chunksize < 1:
            raise ValueError(f"Chunksize must be 1+, not {chunksize}")
        else:
            chunks = [items[i:i + chunksize] for i in range(0, len(items), chunksize)]
        result = MapResult(self, len(chunks), callback, error_callback)
        result._sizes = [len(c) for c in chunks] if deadline is not None else []
        result._call = _call_name("starmap" if kind == _STARMAP else "map", func)
        if chunks:
            self._submit(result, func, kind, chunks, func_bytes, retries)
            self._set_deadline(result, deadline)
        return result

    def map_async(self, func: Callable, iterable: Iterable, chunksize: int | None = None,
                  callback: Callable | None = None, error_callback: Callable | None = None,
                  *, retries: int | None = None, deadline: float | None = None) -> MapResult:
        return self._map_async(func, iterable, _MAP, chunksize, callback, error_callback, retries,
                               deadline)

    def map(self, func: Callable, iterable: Iterable, chunksize: int | None = None,
            *, retries: int | None = None, deadline: float | None = None) -> list:
        return self._map_async(func, iterable, _MAP, chunksize, None, None, retries, deadline).get()

    def starmap_async(self, func: Callable, iterable: Iterable, chunksize: int | None = None,
                      callback: Callable | None = None, error_callback: Callable | None = None,
                      *, retries: int | None = None, deadline: float | None = None) -> MapResult:
        return self._map_async(func, iterable, _STARMAP, chunksize, callback, error_callback, retries,
                               deadline)

    def starmap(self, func: Callable, iterable: Iterable, chunksize: int | None = None,
                *, retries: int | None = None, deadline: float | None = None) -> list:
        return self._map_async(func, iterable, _STARMAP, chunksize, None, None, retries,
                               deadline).get()

    def _imap(self, cls: type, func: Callable, iterable: Iterable, chunksize: int,
              retries: int | None = None, deadline: float | None = None) -> IMapIterator:
        self._check_running()
        _check_deadline(deadline)
        if chunksize < 1:
            raise ValueError(f"Chunksize must be 1+, not {chunksize}")
        retries = self._retries if retries is None else _check_retries(retries)
        with sending_to(self._hub):
            func_bytes = dumps(func)  # an unpicklable function fails here, in the caller
        it = cls(self)
        it._call = _call_name("imap_unordered" if cls is IMapUnorderedIterator else "imap", func)
        with self._lock:
            self._check_running()  # again: the pool may have failed while func was pickled
            self._jobs[it._job_id] = it

        def feed() -> None:
            n = 0
            try:
                source = iter(iterable)
                while True:
                    chunk = list(itertools.islice(source, chunksize))
                    if not chunk:
                        break
                    with sending_to(self._hub):
                        data = dumps(chunk)
                    unit = _Unit(it, n, data, it._job_id, func_bytes, _MAP, len(chunk),
                                 n * chunksize, retries)
                    with self._lock:
                        if self._state == "TERMINATE" or it._closed:
                            return
                        self._queue.append(unit)
                    n += 1
                    self._wake()
            except BaseException as e:
                # The input (or pickling an item of it) failed: that error is the result at
                # this position, after the results of the items before it.
                it._set_unit(n, False, e)
                it._set_length(n + 1)
                return
            it._set_length(n)

        threading.Thread(target=feed, daemon=True, name="fiber-pool-feeder").start()
        self._set_deadline(it, deadline)
        return it

    def imap(self, func: Callable, iterable: Iterable, chunksize: int = 1,
             *, retries: int | None = None, deadline: float | None = None) -> IMapIterator:
        return self._imap(IMapIterator, func, iterable, chunksize, retries, deadline)

    def imap_unordered(self, func: Callable, iterable: Iterable, chunksize: int = 1,
                       *, retries: int | None = None, deadline: float | None = None) -> IMapIterator:
        return self._imap(IMapUnorderedIterator, func, iterable, chunksize, retries, deadline)

    def _set_deadline(self, job: Any, deadline: float | None) -> None:
        if deadline is None:
            return
        with self._lock:
            heapq.heappush(self._deadlines, (time.monotonic() + deadline, job._job_id, deadline, job))
        self._wake()

    def _expire_deadlines(self) -> float | None:
        """Fail the calls whose deadline passed; return the seconds to the next one. Lock held."""
        now = time.monotonic()
        while self._deadlines:
            at, job_id, seconds, job = self._deadlines[0]
            if at > now:
                return at - now
            heapq.heappop(self._deadlines)
            if job_id in self._jobs:
                self._cancel(job)
                job._expire(seconds)
        return None

    # -- lifecycle ----------------------------------------------------------------------

    def resize(self, processes: int) -> None:
        """Grow or shrink the pool to ``processes`` workers (Fiber extension).

        Growing starts new jobs at once (local ones one per CPU at a time, as at
        start). Shrinking retires idle workers first and
        busy ones once their current batch is done; no task is lost. An elastic
        pool's maximum becomes ``processes`` (its minimum no more than that).
        """
        if not isinstance(processes, int) or processes < 1:
            raise ValueError("Number of processes must be at least 1")
        with self._lock:
            self._check_running()
            if self._min == self._processes:
                self._min = processes
            self._processes = processes
            self._min = min(self._min, processes)
            active = [w for w in self._workers.values() if not w.retiring and not w.lost]
            self._top_up()
            extra = len(active) - processes
            for w in sorted(active, key=lambda w: (len(w.pending), not w.ready))[:max(0, extra)]:
                self._retire(w)
        self._wake()

    def close(self) -> None:
        """No more work will be submitted; workers exit once the queued work is done."""
        with self._lock:
            if self._state == "RUN":
                self._state = "CLOSE"
        self._wake()

    def terminate(self) -> None:
        """Stop every worker now. Unfinished results raise instead of hanging."""
        with self._lock:
            if self._state == "TERMINATE" and self._done.is_set():
                return
            self._state = "TERMINATE"
            self._kill_workers()
            self._fail_all_locked(self._error or FiberError("pool was terminated"))
        self._wake()
        self._wait_done()

    def join(self) -> None:
        """Wait for the workers to exit; call :meth:`close` or :meth:`terminate` first."""
        if self._state == "RUN":
            raise ValueError("Pool is still running")
        self._wait_done()

    def _wait_done(self) -> None:
        if threading.current_thread() is self._thread:
            return  # called from a callback, in the master: it ends once the callback returns
        self._done.wait()
        for w in list(self._workers.values()):
            w.process.join()
        runtime().hub.unregister(f"pool:{self._id}")
        status.forget(self)
        self._release()

    def _release(self) -> None:
        """Free the descriptors the master left: no cyclic garbage collection needed."""
        with self._lock:
            self._wake_w.close()  # a later _wake fails quietly
            while True:  # connections of workers that came after the master ended
                try:
                    _, sock = self._incoming.get_nowait()
                except _queue.Empty:
                    break
                sock.close()
            for w in self._workers.values():
                if w.conn is not None:
                    w.conn.close()

    def __enter__(self) -> Pool:
        self._check_running()
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate()

    def __reduce__(self) -> None:  # type: ignore[override]
        raise NotImplementedError(
            "pool objects cannot be passed between processes or pickled")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} state={self._state} pool_size={self._processes}>"

    @property
    def _pool(self) -> list[Process]:
        """The worker processes (the stdlib attribute some programs read)."""
        with self._lock:
            return [w.process for w in self._workers.values()]
