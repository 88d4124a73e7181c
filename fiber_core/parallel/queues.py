"""``Queue``, ``SimpleQueue`` and ``JoinableQueue`` for the processes of a run.

A queue lives in the process that created it (its *owner*). The owner reads and
writes it in memory; every other process, on any host, holds a handle that talks
to the owner over one authenticated connection per thread. Items travel as
pickled bytes and are unpickled only by the process that gets them. A queue
works as long as its owner runs, which for the usual program (the main process
creates the queues) is the whole run.

Lending. A remote ``get()`` is a request and a reply, which would cap a child
draining a busy queue at one item per round trip. A handle that is called in a
tight loop therefore asks for up to ``window`` items at once, sized from how fast
its program has been taking them. The owner *lends* them: they stay in the
connection's lending table until the handle's ``get()`` hands each to the program
and acknowledges it. Nothing lent is stranded or lost:

* when any getter finds the queue empty while items are lent, the owner recalls
  them: a thread of the borrowing handle answers at once, whether or not its
  program is calling ``get()``, and the unused items go back to the front. A
  non-blocking get that found nothing finds them on a later try. (A borrower
  whose process is stopped, e.g. by SIGSTOP, answers when it resumes or when its
  connection ends.);
* a borrower that took nothing for :data:`_IDLE_LOAN` is asked for its items
  back too, so that older items do not wait behind newer ones that other getters
  take;
* when the borrower's connection ends (it exits, is killed, its host is lost
  past ``peer_timeout``), every unacknowledged item goes back to the front;
* a handle acknowledges the items its program took in runs, about a millisecond
  later (longer while its program holds the GIL in a long C call), and at once
  when it closes or its process ends. If its connection ends before that, those
  items are delivered again to other getters: not lost, as they would be from a
  ``multiprocessing.Queue``. If the handle's process lives (its connection was cut, the
  owner lives), its next call raises :class:`~fiber_core.base.errors.QueueCutError`
  saying how many: a cut never delivers an item twice silently.

Once a handle borrows, all its gets and size requests use the borrowing
connection, so that nothing it asks overtakes what it gave back.

For ``qsize()`` and ``empty()``, a lent item counts as taken, except in the
borrowing handle itself: a process that reports having taken everything must not
leave the owner seeing items that are only waiting for an acknowledgement. For
``maxsize``, a lent item keeps its room until it is taken (``full()`` says so).
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
import time
import weakref
from collections import deque

from fiber_core.base.errors import FiberError, QueueCutError
from fiber_core.parallel.queue_serve import Empty, Full, Store, serve
from fiber_core.runtime.hub import dial
from fiber_core.runtime.run import outgoing_addresses, runtime
from fiber_core.wire.framing import Connection, FrameReader, framed
from fiber_core.wire.messages import (
    QUEUE_BATCH,
    QUEUE_EMPTY,
    QUEUE_FULL,
    QUEUE_GOT,
    QUEUE_ITEM,
    QUEUE_JOIN,
    QUEUE_OK,
    QUEUE_RECALL,
    QUEUE_SIZE,
    QUEUE_SIZES,
    QUEUE_TASK_DONE,
    QUEUE_TOO_MANY_DONE,
    body,
    decode_queue_batch,
    decode_queue_sizes,
    encode_queue_ack,
    encode_queue_get,
    encode_queue_loan,
    encode_queue_put,
    encode_queue_return,
    kind_of,
    unexpected,
)
from fiber_core.wire.serialize import dumps, loads

TYPE_CHECKING = False  # typing's own, without importing typing: a job starts without it
if TYPE_CHECKING:
    from typing import Any

_MAX_WINDOW = 512  # items lent at once, at most


_WINDOW_SECONDS = 0.002  # a window holds what the program takes in about this long


_ACK_DELAY = 0.001  # a borrower acknowledges what its program took about this late


class _Borrower:
    """A handle's connection for lent items: who reads it, and a thread that acks.

    One thread at a time reads the connection. A thread that waits for the answer to
    its own request reads it itself, so that a lent item reaches its caller without a
    hand-over between threads; the reader thread reads it only while nobody else does
    and it is needed: while lent items wait here unused (a recall must be answered even
    while the program is busy elsewhere), or while an answer is due that no thread is
    waiting for (its getter was interrupted). Items taken by :meth:`get` are
    acknowledged in runs, by the acker within :data:`_ACK_DELAY`, or first thing before
    any other message. All sends happen under ``cond``'s lock, so the owner sees
    acknowledgements and returns in the order in which items were taken.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.conn = Connection(sock)
        self.frames = FrameReader(sock)  # read by the thread that holds ``reading``
        self.token = int.from_bytes(os.urandom(8), "big") >> 1 or 1
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.items: deque[memoryview] = deque()
        self.asked = 0  # get requests sent
        self.answered = 0  # ... and answered
        self.empty_answers: set[int] = set()
        self.size_asked = self.size_answered = 0
        self.size_reply = (0, 0)
        self.reading = False  # a thread reads the connection now
        self.awaiting = 0  # threads waiting for the answer to a request of their own
        self.reader_due = threading.Condition(self.lock)
        self.acked = 0  # items acknowledged ...
        self.unacked = 0  # ... and taken since
        self.ack_due = threading.Condition(self.lock)
        self.acker_idle = False  # the acker waits for a first unacknowledged item
        self.error: BaseException | None = None
        self.cut_taken = 0  # taken, unacknowledged when the connection ended: to be reported
        self.closed = False
        self.conn.send_frame(encode_queue_loan(self.token))
        _borrowers.add(self)
        threading.Thread(target=self._read_loop, name="fiber-queue-borrower",
                         daemon=True).start()
        threading.Thread(target=self._ack_loop, name="fiber-queue-acker", daemon=True).start()

    def _send(self, msg: bytes) -> None:
        """Send ``msg`` after the acknowledgements due (``cond``'s lock is held)."""
        if self.unacked:
            ack = encode_queue_ack(self.unacked)
            if msg:  # both frames in one write
                self.conn._socket().sendall(framed(ack) + framed(msg))  # noqa: SLF001 - the owner's side of a Connection, in the same layer: one sendall for two frames
            else:
                self.conn.send_frame(ack)
            self.acked += self.unacked
            self.unacked = 0
        elif msg:
            self.conn.send_frame(msg)

    def _taken(self) -> memoryview:
        """The next lent item, taken by the program (``cond``'s lock is held)."""
        data = self.items.popleft()
        self.unacked += 1
        if self.unacked == 1 and self.acker_idle:
            self.ack_due.notify()
        return data

    def _ack_loop(self) -> None:
        with self.ack_due:
            while not self.closed and self.error is None:
                if not self.unacked:
                    self.acker_idle = True
                    self.ack_due.wait()
                    self.acker_idle = False
                    continue
                self.ack_due.wait(_ACK_DELAY)  # the program usually takes more meanwhile
                try:
                    self._send(b"")
                except OSError as e:
                    self._broken(e)
                    return

    def _broken(self, e: BaseException) -> None:
        """The connection ended (``cond``'s lock held). The owner takes back whatever it lent
        and was not acknowledged: handing out what is left here would deliver it twice, and
        what the program took unacknowledged is reported by the next call (:class:`QueueCutError`)."""
        if self.error is None:
            self.error = e
            if not self.closed:
                self.cut_taken = self.unacked
        self.items.clear()
        self.cond.notify_all()
        self.ack_due.notify()
        self.reader_due.notify()

    def report_cut(self) -> None:
        """Raise :class:`QueueCutError` once if the connection ended while the program held
        items taken and unacknowledged."""
        with self.cond:
            taken, self.cut_taken = self.cut_taken, 0
        if taken:
            raise QueueCutError(taken) from self.error

    def settle(self) -> None:
        """Acknowledge what the program took, then let the owner take back the rest."""
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.items.clear()
            try:
                self._send(b"")
                self.conn._socket().shutdown(socket.SHUT_RDWR)  # noqa: SLF001 - the owner's side of a Connection, in the same layer: shut down under a blocked reader
            except OSError:
                pass
            self.conn.close()
            self.ack_due.notify()
            self.reader_due.notify()
            self.cond.notify_all()  # a get() waiting on an answer ends
        _borrowers.discard(self)

    def busy(self) -> bool:
        """Whether it holds items or awaits an answer (then gets must go through it)."""
        return bool(self.items) or self.asked > self.answered

    def take(self) -> memoryview | None:
        """A lent item, if one is here (the fast path of ``get``)."""
        with self.lock:
            if not self.items or self.closed or self.error is not None:
                return None
            return self._taken()

    def held(self) -> int:
        """Items lent to this handle and not yet taken."""
        with self.cond:
            return len(self.items)

    def sizes(self) -> tuple[int, int] | None:
        """The owner's (waiting, room used), asked on this connection; None if it is busy.

        On this connection the request follows whatever this handle gave back or
        acknowledged, so the owner counts it all first.
        """
        with self.cond:
            if self.closed or self.error is not None or self.asked > self.answered:
                return None
            self.size_asked += 1
            mine = self.size_asked
            self._send(QUEUE_SIZE)
            self.awaiting += 1
            try:
                while self.size_answered < mine:
                    if self.error is not None or self.closed:
                        return None
                    self._await_answer()
            finally:
                self.awaiting -= 1
                self._leave()
            waiting, room = self.size_reply
            return waiting + len(self.items), room

    def get(self, block: bool, timeout: float | None, window: int) -> memoryview:
        if timeout is not None and timeout < 0:
            raise ValueError("'timeout' must be a non-negative number")
        end = None if timeout is None or not block else time.monotonic() + timeout
        mine = 0  # the number of this thread's request, once sent
        with self.cond:
            try:
                while True:
                    if self.closed:
                        raise ValueError("the queue was closed")
                    if self.items and self.error is None:
                        return self._taken()
                    if self.error is not None:
                        if self.cut_taken:
                            taken, self.cut_taken = self.cut_taken, 0
                            raise QueueCutError(taken) from self.error
                        raise FiberError("the process that created this queue has exited") \
                            from self.error
                    if mine and self.answered >= mine:
                        if mine in self.empty_answers:
                            self.empty_answers.discard(mine)
                            raise Empty
                        mine = 0  # answered, but other threads took the items: ask again
                        self.awaiting -= 1
                    left = None if end is None else end - time.monotonic()
                    if not mine and self.asked == self.answered:
                        if left is not None and left <= 0:
                            raise Empty
                        request = encode_queue_get(block, None if left is None else max(left, 0.0),
                                                   window)
                        try:
                            self._send(request)
                        except OSError as e:
                            self._broken(e)
                            continue
                        self.asked += 1
                        mine = self.asked
                        self.awaiting += 1
                        self._await_answer()
                    elif not mine:  # another thread's request is out
                        if not block or (left is not None and left <= 0):
                            raise Empty
                        self.cond.wait(left)
                    else:
                        self._await_answer()  # the owner answers by the request's own timeout
            finally:
                if mine:
                    self.awaiting -= 1
                self._leave()

    def _await_answer(self) -> None:
        """Read the next frame if no other thread reads, else wait for one that does
        (``cond``'s lock is held; it is let go meanwhile)."""
        if self.reading:
            self.cond.wait()
            return
        self.reading = True
        msg = None
        self.lock.release()
        try:
            msg = self.frames.recv_bytes()
        except (EOFError, OSError, ValueError) as e:
            self.lock.acquire()
            self.reading = False
            self._broken(e)
            return
        except BaseException:
            self.lock.acquire()
            self.reading = False
            self.cond.notify_all()  # another thread takes over the reading
            raise
        self.lock.acquire()
        self.reading = False
        if not self.closed:  # else what still comes goes back to the owner with the connection
            try:
                self._dispatch(msg)
            except (OSError, ValueError) as e:  # a recall not answered, a frame out of place
                self._broken(e)
                return
        self.cond.notify_all()

    def _unattended(self) -> bool:
        """Whether the reader thread must read: nobody does, and unused items wait here or
        an answer is due that no thread waits for."""
        return not self.reading and (bool(self.items) or not self.awaiting and (
            self.asked > self.answered or self.size_asked > self.size_answered))

    def _leave(self) -> None:
        """A caller leaves (``cond``'s lock is held): wake the reader thread if it must read."""
        if self._unattended() and self.error is None and not self.closed:
            self.reader_due.notify()

    def _read_loop(self) -> None:
        with self.cond:
            while not self.closed and self.error is None:
                if not self._unattended():
                    self.reader_due.wait()
                    continue
                self._await_answer()

    def _dispatch(self, msg: bytes | bytearray) -> None:
        """Take in one frame from the owner (``cond``'s lock is held)."""
        op = kind_of(msg)
        if op == QUEUE_ITEM:
            self.items.append(body(msg))
            self.answered += 1
        elif op == QUEUE_BATCH:
            self.items.extend(decode_queue_batch(msg))
            self.answered += 1
        elif op == QUEUE_EMPTY:
            self.answered += 1
            self.empty_answers.add(self.answered)
        elif op == QUEUE_SIZES:
            self.size_reply = decode_queue_sizes(msg)
            self.size_answered += 1
        elif op == QUEUE_RECALL:  # another getter waits: give back what is unused
            n = len(self.items)
            self.items.clear()
            self._send(encode_queue_return(n))
        else:
            raise unexpected(msg, "a borrowing queue handle's connection")


_borrowers: weakref.WeakSet[_Borrower] = weakref.WeakSet()


def settle() -> None:
    """Acknowledge, before this process ends, every item its program took from a queue."""
    for borrower in list(_borrowers):
        borrower.settle()


atexit.register(settle)


class Queue:
    """A process-shared FIFO queue, like :class:`multiprocessing.Queue`.

    ``qsize()`` works on every platform. There is no feeder thread: ``put``
    pickles at once and, for unbounded queues, returns when the item is handed
    to the operating system, so ``close()`` and ``join_thread()`` have nothing to
    wait for.
    """

    def __init__(self, maxsize: int = 0, *, ctx: Any = None) -> None:

        if maxsize < 0:
            maxsize = 0
        self._maxsize = maxsize
        self._id = os.urandom(16).hex()
        store = Store(maxsize)
        self._store: Store | None = store
        hub = runtime().hub
        hub.register(f"queue:{self._id}", lambda target, sock: serve(store, sock))
        self._hub = hub.addresses
        self._after_init()

    def _after_init(self) -> None:
        self._closed = False
        self._local = threading.local()
        self._borrower: _Borrower | None = None
        self._borrower_lock = threading.Lock()
        self._taken = 0  # items this handle's get() returned
        self._mark: tuple[float, int] | None = None  # when the last fetch returned, and _taken
        self._pace: float | None = None  # the program's seconds per item, smoothed

    def __getstate__(self) -> dict:

        hub = outgoing_addresses(self._hub) if self._store is not None else self._hub
        return {"maxsize": self._maxsize, "id": self._id, "hub": hub}

    def __setstate__(self, state: dict) -> None:
        self._maxsize, self._id, self._hub = state["maxsize"], state["id"], state["hub"]
        self._store = None
        self._after_init()

    # -- transport for non-owners --------------------------------------------------

    def _conn(self) -> Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:

            try:
                sock = dial(self._hub, runtime().authkey, f"queue:{self._id}")
            except ConnectionError as e:
                raise FiberError(f"the process that created this queue is unreachable: {e}") from e
            conn = self._local.conn = Connection(sock)
        return conn

    def _call(self, request: bytes) -> bytes:
        conn = self._conn()
        try:
            conn.send_frame(request)
            return conn.recv_bytes()
        except (EOFError, OSError) as e:
            self._local.conn = None
            raise FiberError("the process that created this queue has exited") from e

    # -- the multiprocessing.Queue API ----------------------------------------------

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        data = dumps(obj)
        if self._store is not None:
            self._store.put(data, block, timeout)
            return
        head = encode_queue_put(block, timeout)
        if self._maxsize > 0:
            reply = kind_of(self._call(head + data))
            if reply == QUEUE_FULL:
                raise Full
            if reply != QUEUE_OK:
                raise unexpected(reply, "a queue handle, in answer to a put")
            return
        try:
            self._conn().send_frame(head, data)
        except OSError as e:
            self._local.conn = None
            raise FiberError("the process that created this queue has exited") from e

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        if self._store is not None:
            return loads(self._store.get(block, timeout))
        borrower = self._borrower
        if borrower is not None:
            data = borrower.take()
            if data is not None:
                self._taken += 1
                return loads(data)
        return loads(self._fetch(block, timeout, borrower))

    def _fetch(self, block: bool, timeout: float | None, borrower: _Borrower | None) -> Any:
        """Ask the owner: one item, or a batch sized from the program's recent pace."""
        if borrower is not None and borrower.error is not None:
            borrower.report_cut()
        now = time.monotonic()
        if self._mark is not None:
            # Since the last fetch returned, the program handled what it returned and
            # everything it took from the borrowed batch.
            at, taken = self._mark
            pace = (now - at) / (self._taken - taken + 1)
            self._pace = pace if self._pace is None else (self._pace + pace) / 2
        try:
            window = 1 if self._pace is None else int(_WINDOW_SECONDS / max(self._pace, 1e-6))
            # Once this handle borrows, its gets stay on that connection: a plain get
            # on another one could overtake items it is giving back (order, qsize).
            if window > 1 or (borrower is not None and borrower.error is None):
                data = self._borrow().get(block, timeout, max(1, min(window, _MAX_WINDOW)))
            else:
                conn = self._conn()
                reply = self._call(encode_queue_get(block, timeout))
                op = kind_of(reply)
                if op == QUEUE_EMPTY:
                    raise Empty
                if op != QUEUE_ITEM:
                    raise unexpected(reply, "a queue handle, in answer to a get")
                try:
                    conn.send_frame(QUEUE_GOT)  # got it: the owner forgets the item
                except OSError:
                    pass
                data = body(reply)
            self._taken += 1
            return data
        finally:
            self._mark = (time.monotonic(), self._taken)

    def _borrow(self) -> _Borrower:
        with self._borrower_lock:
            if self._closed:
                raise ValueError(f"Queue {self!r} is closed")
            borrower = self._borrower
            if borrower is not None and borrower.error is not None:
                borrower.report_cut()  # before a new connection is taken: once
            if borrower is None or borrower.error is not None and not borrower.busy():

                try:
                    sock = dial(self._hub, runtime().authkey, f"queue:{self._id}")
                except ConnectionError as e:
                    raise FiberError(
                        f"the process that created this queue is unreachable: {e}") from e
                borrower = self._borrower = _Borrower(sock)
                # A handle dropped without close(): its threads end and the owner takes
                # back what it lent.
                weakref.finalize(self, borrower.settle)
            return borrower

    def put_nowait(self, obj: Any) -> None:
        self.put(obj, False)

    def get_nowait(self) -> Any:
        return self.get(False)

    def qsize(self) -> int:
        if self._store is not None:
            return self._store.qsize()
        return self._sizes()[0]

    def _sizes(self) -> tuple[int, int]:
        """(items waiting, room used) as this handle sees them (its own loan counts)."""
        borrower = self._borrower
        sizes = borrower.sizes() if borrower is not None else None
        if sizes is None:
            reply = self._call(QUEUE_SIZE)
            if kind_of(reply) != QUEUE_SIZES:
                raise unexpected(reply, "a queue handle, in answer to a size request")
            waiting, used = decode_queue_sizes(reply)
            held = borrower.held() if borrower is not None and borrower.error is None else 0
            sizes = (waiting + held, used)
        return sizes

    def empty(self) -> bool:
        return self.qsize() == 0

    def full(self) -> bool:
        """Whether a ``put`` would wait: lent items keep their room until they are taken."""
        if self._maxsize <= 0:
            return False
        if self._store is not None:
            return self._store.room_used() >= self._maxsize
        return self._sizes()[1] >= self._maxsize

    def close(self) -> None:
        with self._borrower_lock:
            self._closed = True
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
        borrower, self._borrower = self._borrower, None
        if borrower is not None:
            borrower.settle()  # the owner takes back what it lent and was not taken

    def join_thread(self) -> None:
        if not self._closed:
            raise AssertionError("Queue.join_thread() requires close() first")

    def cancel_join_thread(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<{type(self).__name__} id={self._id[:8]} maxsize={self._maxsize}>"


class JoinableQueue(Queue):
    """A :class:`Queue` with ``task_done()`` and ``join()``."""

    def task_done(self) -> None:
        if self._store is not None:
            self._store.task_done()
        else:
            reply = kind_of(self._call(QUEUE_TASK_DONE))
            if reply == QUEUE_TOO_MANY_DONE:
                raise ValueError("task_done() called too many times")
            if reply != QUEUE_OK:
                raise unexpected(reply, "a queue handle, in answer to task_done()")

    def join(self) -> None:
        if self._store is not None:
            self._store.join()
        else:
            reply = self._call(QUEUE_JOIN)
            if kind_of(reply) != QUEUE_OK:
                raise unexpected(reply, "a queue handle, in answer to join()")


class SimpleQueue(Queue):
    """An unbounded queue with ``get``, ``put``, ``empty`` and ``close``."""

    def __init__(self, *, ctx: Any = None) -> None:
        super().__init__(0)

