"""The owner's serving side of a queue: its store and one session per client connection.

:class:`Store` holds a queue's items in the owning process, with the lending
table of every borrowing connection; :func:`serve` answers one client connection
of a queue (the QUEUE_ kinds of :mod:`fiber_core.wire.messages`) in the hub
thread that accepted it. :mod:`fiber_core.parallel.queues` describes lending.
"""

from __future__ import annotations

import queue as _stdqueue
import socket
import threading
import time
from collections import deque
from typing import Any

from fiber_core.base.fds import readable
from fiber_core.wire.framing import Connection, FrameReader, framed
from fiber_core.wire.messages import (
    QUEUE_ACK,
    QUEUE_EMPTY,
    QUEUE_FULL,
    QUEUE_GET,
    QUEUE_GOT,
    QUEUE_ITEM,
    QUEUE_JOIN,
    QUEUE_LOAN,
    QUEUE_OK,
    QUEUE_PUT,
    QUEUE_RECALL,
    QUEUE_RETURN,
    QUEUE_SIZE,
    QUEUE_TASK_DONE,
    QUEUE_TOO_MANY_DONE,
    decode_queue_ack,
    decode_queue_get,
    decode_queue_loan,
    decode_queue_put,
    decode_queue_put_item,
    decode_queue_return,
    encode_queue_batch,
    encode_queue_sizes,
    kind_of,
    unexpected,
)

Empty = _stdqueue.Empty


Full = _stdqueue.Full


_Item = bytes | bytearray | memoryview  # a pickled item, as it came in


_CLIENT_CHECK = 0.2  # seconds between checks that a client blocked in get() still lives


_BATCH_BYTES = 1 << 18  # a batch stops growing past this many bytes (it has at least one item)


_IDLE_LOAN = 0.02  # a borrower that takes nothing for this long is asked for its items back


_RECALL_TICK = 0.01  # how often the owner looks for idle loans while items are lent


_RECALL_RETRY = 0.05  # a getter waiting while items are lent asks for a recall this often


class _Loan:
    """The items one client connection has borrowed and not yet acknowledged."""

    def __init__(self, conn: Connection, send_lock: threading.Lock) -> None:
        self.conn = conn
        self.send_lock = send_lock
        self.lent: deque[_Item] = deque()
        self.active = time.monotonic()  # when it last borrowed or acknowledged
        self.recalling = False


class Store:
    """The owner's in-memory queue: pickled items, with the stdlib's blocking rules."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self.items: deque[_Item] = deque()
        self.lock = threading.Lock()
        self.not_empty = threading.Condition(self.lock)
        self.not_full = threading.Condition(self.lock)
        self.all_done = threading.Condition(self.lock)
        self.unfinished = 0
        self.loans: dict[int, _Loan] = {}
        self.lent = 0  # items lent and not yet acknowledged: they still take room
        self.recall_wanted = threading.Condition(self.lock)
        self.want_recall = False
        self.recaller: threading.Thread | None = None
        self.recaller_idle = False  # the recaller waits for a first lent item

    def put(self, data: _Item, block: bool = True, timeout: float | None = None) -> None:
        with self.lock:
            if self.maxsize > 0:
                if not block:
                    if len(self.items) + self.lent >= self.maxsize:
                        raise Full
                elif timeout is None:
                    while len(self.items) + self.lent >= self.maxsize:
                        self.not_full.wait()
                else:
                    if timeout < 0:
                        raise ValueError("'timeout' must be a non-negative number")
                    end = time.monotonic() + timeout
                    while len(self.items) + self.lent >= self.maxsize:
                        left = end - time.monotonic()
                        if left <= 0:
                            raise Full
                        self.not_full.wait(left)
            self.items.append(data)
            self.unfinished += 1
            if self.not_empty._waiters:  # type: ignore[attr-defined]  # a getter waits  # noqa: SLF001 - threading.Condition keeps its waiters private; no public way to ask
                self.not_empty.notify()

    def get(self, block: bool = True, timeout: float | None = None, lend: bool = False) -> _Item:
        """Take the next item; one to ``lend`` keeps taking room until it is acknowledged."""
        with self.not_empty:
            if not block:
                if not self.items:
                    self._recall()  # what is lent and unused comes back for a later get
                    raise Empty
            elif timeout is None:
                while not self.items:
                    self._recall()
                    # A recall can be answered before the items it was meant for were
                    # sent: while items are lent, ask again now and then.
                    self.not_empty.wait(_RECALL_RETRY if self.lent else None)
            else:
                if timeout < 0:
                    raise ValueError("'timeout' must be a non-negative number")
                end = time.monotonic() + timeout
                while not self.items:
                    self._recall()
                    left = end - time.monotonic()
                    if left <= 0:
                        raise Empty
                    self.not_empty.wait(min(left, _RECALL_RETRY) if self.lent else left)
            data = self.items.popleft()
            if lend:
                self.lent += 1
            else:
                self.not_full.notify()
            return data

    # -- lending (the lock is held by the caller of every method below) ----------------

    def lend(self, loan: _Loan, first: _Item, window: int) -> list[_Item]:
        """``first`` (already taken) and up to ``window - 1`` more items, lent to ``loan``."""
        batch = [first]  # counted in ``lent`` by ``get(lend=True)``
        size = len(first)
        items = self.items
        while items and len(batch) < window and size < _BATCH_BYTES:
            data = items.popleft()
            batch.append(data)
            size += len(data)
        loan.lent.extend(batch)
        loan.active = time.monotonic()
        if self.lent == 1 and self.recaller_idle:  # the first lent item (``get`` counted it)
            self.recall_wanted.notify()  # idle loans are watched from now on
        self.lent += len(batch) - 1
        return batch

    def ack(self, loan: _Loan, n: int) -> None:
        taken = min(n, len(loan.lent))
        for _ in range(taken):
            loan.lent.popleft()
        self.lent -= taken
        loan.active = time.monotonic()
        if taken and self.maxsize > 0:
            self.not_full.notify(taken)

    def give_back(self, loan: _Loan, n: int | None = None) -> None:
        """Put the first ``n`` (default all) unacknowledged items of ``loan`` back in front."""
        lent = loan.lent
        back = list(lent) if n is None else [lent[i] for i in range(min(n, len(lent)))]
        for _ in range(len(back)):
            lent.popleft()
        self.lent -= len(back)
        self.items.extendleft(reversed(back))
        loan.recalling = False
        if back:
            self.not_empty.notify(len(back))

    def _recall(self) -> None:
        """Have the recaller ask every borrower for its unused items: a getter waits."""
        if self.lent and not self.want_recall:
            self.want_recall = True
            self.recall_wanted.notify()

    def start_recaller(self) -> None:
        """Start the recaller (the lock is held); it ends when the last loan does."""
        if self.recaller is None:
            self.recaller = threading.Thread(target=self._recall_loop, name="fiber-queue-recall",
                                             daemon=True)
            self.recaller.start()

    def _recall_loop(self) -> None:
        """Send recalls: to every borrower when a getter waits, to idle ones all along.

        A borrower that stopped taking keeps older items from the other getters, so
        those items are fetched back once it has been idle for :data:`_IDLE_LOAN`.
        """
        with self.lock:
            while True:
                if not self.loans:
                    self.recaller = None
                    return
                if not self.want_recall:
                    self.recaller_idle = not self.lent
                    self.recall_wanted.wait(_RECALL_TICK if self.lent else None)
                    self.recaller_idle = False
                now = time.monotonic()
                everyone, self.want_recall = self.want_recall, False
                targets = [loan for loan in self.loans.values()
                           if loan.lent and not loan.recalling
                           and (everyone or now - loan.active >= _IDLE_LOAN)]
                for loan in targets:
                    loan.recalling = True
                if not targets:
                    continue
                self.lock.release()
                try:
                    unsent = [loan for loan in targets if not _send_recall(loan)]
                finally:
                    self.lock.acquire()
                for loan in unsent:
                    loan.recalling = False  # tried again on the next round

    def put_many(self, items: list[_Item]) -> None:
        """Append ``items`` to an unbounded queue (which never blocks)."""
        with self.lock:
            self.items.extend(items)
            self.unfinished += len(items)
            self.not_empty.notify(len(items))

    def unget(self, data: _Item, lent: bool = False) -> None:
        """Put back, first in line, an item that its getter did not live to receive."""
        with self.lock:
            if lent:
                self.lent -= 1
            self.items.appendleft(data)
            self.not_empty.notify()

    def qsize(self) -> int:
        """Items waiting here (lent ones count as taken: see the module's docstring)."""
        with self.lock:
            return len(self.items)

    def room_used(self) -> int:
        """What counts against ``maxsize``: items waiting here and items lent."""
        with self.lock:
            return len(self.items) + self.lent

    def task_done(self) -> None:
        with self.lock:
            if self.unfinished <= 0:
                raise ValueError("task_done() called too many times")
            self.unfinished -= 1
            if self.unfinished == 0:
                self.all_done.notify_all()

    def join(self) -> None:
        with self.all_done:
            while self.unfinished:
                self.all_done.wait()


_RECALL_FRAME = framed(QUEUE_RECALL)


def _send_recall(loan: _Loan) -> bool:
    """Send QUEUE_RECALL without waiting on a borrower that does not read (stopped, cut off)."""
    if not loan.send_lock.acquire(blocking=False):
        return False  # a batch is on its way: next round
    try:
        frame = _RECALL_FRAME
        sock = loan.conn._socket()  # noqa: SLF001 - the owner's side of a Connection, in the same layer: the socket itself for a loan
        sent = sock.send(frame, socket.MSG_DONTWAIT)
        if sent < len(frame):
            sock.sendall(frame[sent:])  # never split a frame
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True  # its connection is ending: the items come back with it
    finally:
        loan.send_lock.release()


def _peer_gone(sock: socket.socket) -> bool:
    """Whether the client closed ``sock`` (it sends nothing while it waits for a reply)."""
    try:
        return readable(sock) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _get_for(store: Store, sock: socket.socket, block: bool, timeout: float | None,
             lend: bool = False) -> _Item:
    """``store.get()`` for a client; given up if the client dies while it waits.

    A process terminated while blocked in ``get()`` must not take the next item with it.
    (An item lent to it comes back with its connection: no check for it.)
    """
    try:
        return store.get(False, lend=lend)
    except Empty:
        if not block:
            raise
    end = None if timeout is None else time.monotonic() + timeout
    while True:
        left = _CLIENT_CHECK if end is None else min(_CLIENT_CHECK, end - time.monotonic())
        try:
            item = store.get(True, max(left, 0.0), lend)
        except Empty:
            if end is not None and time.monotonic() >= end:
                raise
            if _peer_gone(sock):
                raise EOFError("the client went away") from None
            continue
        if not lend and _peer_gone(sock):
            store.unget(item)
            raise EOFError("the client went away")
        return item


class _Session:
    """One client connection of a queue as its owner serves it: a handler per QUEUE_ kind.

    An item sent for a plain get goes back in front if the connection ends before
    its QUEUE_GOT.
    """

    __slots__ = ("store", "sock", "conn", "reader", "send_lock", "loan", "token", "pending",
                 "sent")

    def __init__(self, store: Store, sock: socket.socket) -> None:
        self.store = store
        self.sock = sock
        self.conn = Connection(sock)
        self.reader = FrameReader(sock)  # a client's puts are not answered: read them in batches
        self.send_lock = threading.Lock()  # the recaller sends on a borrowing connection too
        self.loan: _Loan | None = None
        self.token = 0
        self.pending: Any = None  # a request read ahead
        self.sent: _Item | None = None  # an item sent by a plain get, until the client has it

    def run(self) -> None:
        """Answer requests until the client goes away; then give back what it held."""
        handler_of, recv = _HANDLERS.get, self.reader.recv_bytes
        try:
            while True:
                msg = self.pending
                if msg is None:
                    msg = recv()
                else:
                    self.pending = None
                handler = handler_of(msg[0]) if msg else None  # a big frame is a bytearray
                if handler is None:
                    raise unexpected(msg, "the connection of a queue's owner")
                handler(self, msg)
        except (EOFError, OSError):
            pass
        finally:
            self._end()

    def _run_of(self, kind: bytes, first: Any, decode: Any) -> list[Any]:
        """``first`` decoded, and the following frames of ``kind`` already buffered."""
        reader = self.reader
        run = [decode(first)]
        while reader.buffered():
            msg = reader.recv_bytes()
            if kind_of(msg) != kind:
                self.pending = msg
                break
            run.append(decode(msg))
        return run

    def _borrowing(self, msg: Any) -> _Loan:
        if self.loan is None:
            raise unexpected(msg, "a queue connection that borrows nothing")
        return self.loan

    def on_got(self, msg: Any) -> None:
        self.sent = None

    def on_put(self, msg: Any) -> None:
        store = self.store
        if store.maxsize <= 0:
            # Unbounded: a put neither blocks nor gets a reply, so store at once all
            # the puts that came in together.
            store.put_many(self._run_of(QUEUE_PUT, msg, decode_queue_put_item))
            return
        block, timeout, data = decode_queue_put(msg)
        try:
            store.put(data, block, timeout)
            reply = QUEUE_OK
        except Full:
            reply = QUEUE_FULL
        self.conn.send_frame(reply)

    def on_ack(self, msg: Any) -> None:
        """Acknowledgements come in runs: take a run at once."""
        loan = self._borrowing(msg)
        n = sum(self._run_of(QUEUE_ACK, msg, decode_queue_ack))
        with self.store.lock:
            self.store.ack(loan, n)

    def on_get(self, msg: Any) -> None:
        store, conn, loan = self.store, self.conn, self.loan
        block, timeout, window = decode_queue_get(msg)
        try:
            item = _get_for(store, self.sock, block, timeout, loan is not None)
        except Empty:
            with self.send_lock:
                conn.send_frame(QUEUE_EMPTY)
            return
        if loan is None:  # a plain get: the client says QUEUE_GOT once it has the item
            self.sent = item
            conn.send_frame(QUEUE_ITEM, item)
            return
        with store.lock:
            batch = store.lend(loan, item, window or 1)
        with self.send_lock:
            if len(batch) == 1:
                conn.send_frame(QUEUE_ITEM, item)
            else:
                conn.send_frame(encode_queue_batch(batch))

    def on_return(self, msg: Any) -> None:
        loan = self._borrowing(msg)
        n = decode_queue_return(msg)
        with self.store.lock:
            self.store.give_back(loan, n)

    def on_loan(self, msg: Any) -> None:
        self.token = decode_queue_loan(msg)
        self.loan = _Loan(self.conn, self.send_lock)
        with self.store.lock:
            self.store.loans[self.token] = self.loan
            self.store.start_recaller()

    def on_size(self, msg: Any) -> None:
        store = self.store
        with store.lock:
            sizes = encode_queue_sizes(len(store.items), len(store.items) + store.lent)
        with self.send_lock:
            self.conn.send_frame(sizes)

    def on_task_done(self, msg: Any) -> None:
        try:
            self.store.task_done()
            self.conn.send_frame(QUEUE_OK)
        except ValueError:
            self.conn.send_frame(QUEUE_TOO_MANY_DONE)

    def on_join(self, msg: Any) -> None:
        self.store.join()
        self.conn.send_frame(QUEUE_OK)

    def _end(self) -> None:
        store = self.store
        if self.sent is not None:
            store.unget(self.sent)  # the client ended before it had the item: first in line again
        if self.loan is not None:
            with store.lock:
                store.loans.pop(self.token, None)
                store.give_back(self.loan)
                store.recall_wanted.notify()  # without loans, the recaller ends
        self.conn.close()


_HANDLERS = {  # keyed by the kind's code (an int): any frame type can look it up
    QUEUE_GOT[0]: _Session.on_got,
    QUEUE_PUT[0]: _Session.on_put,
    QUEUE_ACK[0]: _Session.on_ack,
    QUEUE_GET[0]: _Session.on_get,
    QUEUE_RETURN[0]: _Session.on_return,
    QUEUE_LOAN[0]: _Session.on_loan,
    QUEUE_SIZE[0]: _Session.on_size,
    QUEUE_TASK_DONE[0]: _Session.on_task_done,
    QUEUE_JOIN[0]: _Session.on_join,
}


def serve(store: Store, sock: socket.socket) -> None:
    """Serve one client connection of a queue, in the hub thread that accepted it.

    It speaks the QUEUE_ kinds of :mod:`fiber_core.wire.messages` (see :class:`_Session`).
    """
    _Session(store, sock).run()
