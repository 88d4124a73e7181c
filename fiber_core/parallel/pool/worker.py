"""The worker side of a Pool: what runs in each worker's job, without the master's code.

A worker dials the pool's master, says which worker it is (``POOL_HELLO``), runs the
initializer, says it is ready (``POOL_READY``), then reads batches (``POOL_TASKS``)
and answers each with its results (``POOL_RESULTS``) until told to quit. A *watched*
batch names each item as it starts it (``POOL_RUNNING``), so that a death is charged
to the item that ran (:mod:`fiber_core.parallel.pool.ledger`). SIGTERM makes it
drain (:class:`Drain`). A thread of its own sends ``POOL_HEARTBEAT`` at a low rate
(:class:`Heartbeat`), so that the master can tell a frozen worker from a busy one. Its
process imports this module and the wire, never the master's modules (the package's
``__init__`` loads them on first use only).
"""

from __future__ import annotations

import collections
import itertools
import os
import select
import signal
import threading
import time
from collections.abc import Callable

from fiber_core.base.errors import FiberError
from fiber_core.base.usage import Sampler
from fiber_core.parallel.durable import task as current
from fiber_core.processes.host import output_sent
from fiber_core.runtime.hub import dial
from fiber_core.runtime.run import runtime
from fiber_core.wire.framing import Connection
from fiber_core.wire.messages import (
    POOL_CANCEL,
    POOL_QUIT,
    POOL_READY,
    POOL_RESULTS,
    POOL_TASKS,
    TaskField,
    decode_pool_cancel,
    decode_pool_tasks,
    encode_pool_drain,
    encode_pool_heartbeat,
    encode_pool_hello,
    encode_pool_results,
    encode_pool_running,
    kind_of,
    unexpected,
)
from fiber_core.wire.serialize import dumps, loads

TYPE_CHECKING = False  # typing's own, without importing typing: a job starts without it
if TYPE_CHECKING:
    from typing import Any

DRAIN_GRACE_SECONDS = 25.0
"""Seconds a worker sent SIGTERM may take to finish its batch: within the grace period of
``docker stop`` (10 s by default, often raised) and of a pod (30 s), short of a spot notice (2 min)."""

CANCEL_CHECK_SECONDS = 0.005
"""How often, between the units of a batch, a worker looks for a cancel: a few reads per
batch at most, and a cancelled call stops within this long after its current unit."""

FUNC_CACHE = 64
"""Functions (and cancelled calls) a worker remembers: a call's function is sent once per
worker, and 64 calls in flight at once are more than programs make."""

APPLY, MAP, STARMAP = 0, 1, 2
"""How a unit's items are passed: ``(args, kwds)``, one argument, or unpacked arguments."""


class MaybeEncodingError(FiberError):
    """A task's result (or exception) could not be pickled in the worker."""

    def __init__(self, exc: str, value: str) -> None:
        super().__init__(exc, value)
        self.exc, self.value = exc, value

    def __str__(self) -> str:
        return f"Error sending result: '{self.value}'. Reason: '{self.exc}'"


def run_unit(func: Callable, kind: int, data: bytes,
              notify: Callable[[int], None] | None = None) -> tuple[bool | None, Any]:
    """Run one unit: ``(True, results)``, ``(False, (exc, tb))`` if it raised, or
    ``(None, (message, tb))`` if its arguments could not be unpickled here."""
    try:
        items = loads(data)
    except Exception as e:
        return None, (repr(e), _format_exc())
    try:
        if notify is not None:  # each item's start is told (current_task; a watched batch's master)
            out = []
            for i, item in enumerate(items):
                notify(i)
                if kind == MAP:
                    out.append(func(item))
                elif kind == STARMAP:
                    out.append(func(*item))
                else:
                    args, kwds = item
                    out.append(func(*args, **kwds))
            return True, out
        if kind == MAP:
            return True, list(map(func, items))
        if kind == STARMAP:
            return True, list(itertools.starmap(func, items))
        args, kwds = items[0]
        return True, [func(*args, **kwds)]
    except (Exception, SystemExit, KeyboardInterrupt) as e:
        # sys.exit() and Ctrl-C in a task are the task's result: the worker goes on.
        return False, (e, _format_exc())


def _format_exc() -> str:
    """The traceback being handled, as text; :mod:`traceback` is imported on a worker's first
    error, not at its start (it takes 2 ms of a cold start: tokenize, textwrap, linecache)."""
    import traceback

    return traceback.format_exc()


def encode_results(batch_id: int, elapsed: float, results: list) -> bytes:
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


def load_func(data: bytes) -> Callable:
    """The task's function, or one that raises why it could not be unpickled here."""
    try:
        return loads(data)
    except Exception as e:
        message = f"cannot unpickle the task's function in the worker: {e!r}"

        def unloadable(*args: Any, **kwds: Any) -> Any:
            raise FiberError(message)
        return unloadable


class Drain:
    """A pool worker's answer to SIGTERM (a preemption notice, ``docker stop``, a pod's end).

    It tells the master which batch it still finishes (the master re-queues the
    others at once), runs nothing else, and exits when the master says so, or
    after :data:`DRAIN_GRACE_SECONDS` if the batch is not done by then (the master
    then re-queues it too, uncharged).
    """

    def __init__(self, conn: Connection, lock: threading.Lock) -> None:
        self.conn = conn
        self.lock = lock  # every frame the worker sends, and the fields below
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


class Heartbeat:
    """A daemon thread that sends ``POOL_HEARTBEAT`` every ``interval`` seconds, with a sample
    of the worker's use, under the lock of every frame the worker sends.

    It needs the GIL for some 50 microseconds per beat: a task that sleeps, waits or
    runs a C call that releases the GIL (numpy, hashlib on big buffers, I/O) does not stop
    it; one that holds the GIL past ``heartbeat_timeout`` does, and looks frozen.
    """

    def __init__(self, conn: Connection, lock: threading.Lock, interval: float) -> None:
        self.conn, self.lock, self.interval = conn, lock, interval
        self.stopped = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="fiber-pool-heartbeat").start()

    def _run(self) -> None:
        sampler = Sampler()
        while not self.stopped.wait(self.interval):
            frame = encode_pool_heartbeat(**sampler.sample())
            with self.lock:
                if self.stopped.is_set():
                    return
                try:
                    self.conn.send_frame(frame)
                except OSError:
                    return

    def stop(self) -> None:
        """Send no more (call it with the lock held, before the connection closes)."""
        self.stopped.set()


def read_ahead(conn: Connection, poller: select.poll, inbox: collections.deque[bytes],
                cancelled: collections.OrderedDict[int, None]) -> None:
    """Take the frames that have arrived: cancels into ``cancelled``, the rest into ``inbox``."""
    while poller.poll(0):  # one syscall: this runs before every batch
        msg = conn.recv_bytes()
        if kind_of(msg) == POOL_CANCEL:
            cancelled[decode_pool_cancel(msg)] = None
            if len(cancelled) > FUNC_CACHE:
                cancelled.popitem(last=False)
        else:
            inbox.append(msg)


def _claim(conn: Connection, drain: Drain, batch_id: int, call_id: int,
           cancelled: collections.OrderedDict[int, None], watch: bool) -> bool:
    """Whether to run the batch: not once the worker drains (the master re-queued it), and
    not for a cancelled call (answered with no results). A watched batch's first item is
    announced here, before its function and arguments are loaded: a task whose loading
    kills the worker is charged like one whose run does."""
    with drain.lock:
        if drain.draining:
            return False
        if call_id in cancelled:
            conn.send_frame(POOL_RESULTS, encode_results(batch_id, 0.0, []))
            return False
        drain.current = batch_id
        if watch:
            conn.send_frame(encode_pool_running(batch_id, 0))
        return True


def _run_batch(conn: Connection, drain: Drain, look: Callable[[], None], cancelled: Any,
               batch_id: int, call_id: int, func: Callable, kind: int, units: list[bytes],
               watch: bool, task: TaskField) -> None:
    """Run a batch's units and send their results; ``look`` reads what has arrived meanwhile."""
    def watched(item: int) -> None:
        current.at(item)
        if item:  # the first was announced when the batch was claimed
            with drain.lock:
                conn.send_frame(encode_pool_running(batch_id, item))
    notify = watched if watch else current.at  # each item's position, for current_task()
    ordinal, seed, firsts, attempts = task
    start = checked = time.perf_counter()
    results = []
    last = len(units) - 1
    for i, unit in enumerate(units):
        current.enter(ordinal, firsts[i], attempts[i], seed)
        results.append(run_unit(func, kind, unit, notify))
        current.leave()
        if i == last:
            break  # nothing left that a cancel could spare: no look (a syscall per batch)
        now = time.perf_counter()
        if now - checked > CANCEL_CHECK_SECONDS:  # between units: was the call cancelled?
            checked = now
            look()
            if call_id in cancelled:
                break  # the master drops this call's results: the rest are not started
    elapsed = time.perf_counter() - start
    payload = encode_results(batch_id, elapsed, results)
    output_sent()  # what the units printed goes first: a worker killed once its results are in loses none
    with drain.lock:
        conn.send_frame(POOL_RESULTS, payload)
        drain.current = -1


def worker_main(hub: str, pool_id: str, worker_id: int, initializer: Callable | None,
                initargs: tuple, maxtasks: int | None, heartbeat: float = 0.0) -> None:
    """A pool worker's whole life: connect, initialize, run batches until told to quit;
    ``heartbeat``: seconds between its heartbeats (0: none)."""
    sock = dial(hub, runtime().authkey, f"pool:{pool_id}")
    conn = Connection(sock)
    conn.send_frame(encode_pool_hello(worker_id))
    lock = threading.Lock()  # every frame sent once the heartbeat runs
    beat = Heartbeat(conn, lock, heartbeat) if heartbeat > 0 else None
    if initializer is not None:
        initializer(*initargs)
    drain = Drain(conn, lock)
    with lock:
        conn.send_frame(POOL_READY)
    # Read in this thread: no hand-off to wake up per message. The master only sends
    # to a worker that is idle, or a prefetch small enough to wait in the socket buffer.
    funcs: collections.OrderedDict[int, Callable] = collections.OrderedDict()
    inbox: collections.deque[bytes] = collections.deque()
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    cancelled: collections.OrderedDict[int, None] = collections.OrderedDict()

    def look() -> None:
        try:
            read_ahead(conn, poller, inbox, cancelled)
        except (EOFError, OSError):
            pass

    done = 0
    while maxtasks is None or done < maxtasks:
        try:
            if not inbox:
                inbox.append(conn.recv_bytes())
            read_ahead(conn, poller, inbox, cancelled)  # a cancel may have come after this batch
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
        batch_id, call_id, func_bytes, kind, units, watch, task = decode_pool_tasks(msg)
        claimed = _claim(conn, drain, batch_id, call_id, cancelled, watch)
        if func_bytes is not None:  # (sent once per worker: kept even for a batch not run)
            funcs[call_id] = load_func(func_bytes)
            if len(funcs) > FUNC_CACHE:
                funcs.popitem(last=False)
        if claimed:
            _run_batch(conn, drain, look, cancelled, batch_id, call_id, funcs[call_id], kind, units,
                       watch, task)
            done += len(units)
    with lock:
        if beat is not None:
            beat.stop()
        conn.close()
