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

from fiber_core.base.fds import readable
from fiber_core.wire.framing import Connection, FrameReader, frame_header, framed
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

TYPE_CHECKING = False  # typing's own, without importing typing: a job starts without it
if TYPE_CHECKING:
    from typing import Any

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


class _Local:
    """A thread of the owner waiting in :meth:`Store.get`: the item is handed to it, then its
    lock released (one wakeup, and no lock of the store to take again)."""

    __slots__ = ("wake", "item")

    def __init__(self) -> None:
        self.wake = threading.Lock()
        self.wake.acquire()
        self.item: _Item | None = None


class _Parked:
    """A borrower's blocking get, waiting in the store while its session reads on: the
    thread that brings an item lends it and sends it (no thread of the owner is woken)."""

    __slots__ = ("loan", "window", "served")

    def __init__(self, loan: _Loan, window: int) -> None:
        self.loan = loan
        self.window = window
        self.served = False


class Store:
    """The owner's in-memory queue: pickled items, with the stdlib's blocking rules.

    Getters that find it empty wait in one line, :attr:`waiters`, first come first
    served: a thread of this process (:class:`_Local`), or a borrowing connection's
    get (:class:`_Parked`). Whoever brings an item hands it to the first of them, so
    items and waiters are never both there when the lock is let go.
    """

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self.items: deque[_Item] = deque()
        self.lock = threading.Lock()
        self.waiters: deque[_Local | _Parked] = deque()
        self.parked = 0  # how many of the waiters are borrowers' gets
        self.not_full = threading.Condition(self.lock)
        self.all_done = threading.Condition(self.lock)
        self.unfinished = 0
        self.loans: dict[int, _Loan] = {}
        self.lent = 0  # items lent and not yet acknowledged: they still take room
        self.recall_wanted = threading.Condition(self.lock)
        self.want_recall = False
        self.recalled_at = 0.0  # when the recaller last asked every borrower
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
            if not self.waiters:
                return
            sends = self._serve()
        _deliver(sends)

    def get(self, block: bool = True, timeout: float | None = None) -> _Item:
        """Take the next item (for a thread of this process, or a plain get of a client)."""
        with self.lock:
            if self.items:  # then nobody waits before this getter
                data = self.items.popleft()
                if self.maxsize > 0:
                    self.not_full.notify()
                return data
            self._recall()  # what is lent and unused comes back for this or a later get
            if not block:
                raise Empty
            if timeout is not None and timeout < 0:
                raise ValueError("'timeout' must be a non-negative number")
            waiter = _Local()
            self.waiters.append(waiter)
        return self._wait(waiter, timeout)

    def _wait(self, waiter: _Local, timeout: float | None) -> _Item:
        """Wait until an item is handed to ``waiter``, or ``timeout`` passes (:class:`Empty`)."""
        end = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                left = -1.0 if end is None else max(end - time.monotonic(), 0.0)
                if self.lent:
                    # A recall can be answered before the items it was meant for were
                    # sent: while items are lent, ask again now and then.
                    left = _RECALL_RETRY if left < 0 else min(left, _RECALL_RETRY)
                if waiter.wake.acquire(timeout=left):
                    return waiter.item  # type: ignore[return-value]  # set before the release
                with self.lock:
                    if waiter.item is not None:  # handed over meanwhile
                        return waiter.item
                    if end is not None and time.monotonic() >= end:
                        self.waiters.remove(waiter)
                        raise Empty
                    self._recall()
        except Empty:
            raise
        except BaseException:  # interrupted: the item, if one came, goes back in front
            with self.lock:
                if waiter.item is None:
                    self.waiters.remove(waiter)
                    raise
                self.items.appendleft(waiter.item)
                sends = self._serve()
            _deliver(sends)
            raise

    def lend_or_park(self, loan: _Loan, window: int, block: bool) -> list[_Item] | _Parked:
        """Items lent to ``loan`` for its get: at once, or later by whoever brings one (the
        :class:`_Parked` returned); :class:`Empty` for a get that does not wait."""
        with self.lock:
            if self.items:
                first = self.items.popleft()
                self.lent += 1
                return self.lend(loan, first, window)
            self._recall()
            if not block:
                raise Empty
            parked = _Parked(loan, window)
            self.waiters.append(parked)
            self.parked += 1
            return parked

    def unpark(self, parked: _Parked) -> bool:
        """Take back a borrower's get that waits (the lock is held); False: it was served."""
        if parked.served:
            return False
        self.waiters.remove(parked)
        self.parked -= 1
        return True

    def _serve(self) -> list[tuple[_Loan, list[_Item]]]:
        """Hand the waiting items to the waiting getters in turn (the lock is held).

        A thread of this process is woken; what is lent to a borrower is returned, to be
        sent once the lock is let go (:func:`_deliver`).
        """
        items, waiters = self.items, self.waiters
        sends = []
        while items and waiters:
            waiter = waiters.popleft()
            data = items.popleft()
            if isinstance(waiter, _Local):
                waiter.item = data
                waiter.wake.release()
                if self.maxsize > 0:
                    self.not_full.notify()
            else:
                waiter.served = True
                self.parked -= 1
                self.lent += 1
                sends.append((waiter.loan, self.lend(waiter.loan, data, waiter.window)))
        return sends

    # -- lending (the lock is held by the caller of every method below) ----------------

    def lend(self, loan: _Loan, first: _Item, window: int) -> list[_Item]:
        """``first`` (already taken) and up to ``window - 1`` more items, lent to ``loan``."""
        batch = [first]  # counted in ``lent`` by the caller
        size = len(first)
        items = self.items
        while items and len(batch) < window and size < _BATCH_BYTES:
            data = items.popleft()
            batch.append(data)
            size += len(data)
        loan.lent.extend(batch)
        loan.active = time.monotonic()
        if self.lent == 1 and self.recaller_idle:  # the first lent item (the caller counted it)
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

    def give_back(self, loan: _Loan, n: int | None = None) -> list[tuple[_Loan, list[_Item]]]:
        """Put the first ``n`` (default all) unacknowledged items of ``loan`` back in front;
        what is lent from them to waiting borrowers is returned, to be sent (:func:`_deliver`)."""
        lent = loan.lent
        back = list(lent) if n is None else [lent[i] for i in range(min(n, len(lent)))]
        for _ in range(len(back)):
            lent.popleft()
        self.lent -= len(back)
        self.items.extendleft(reversed(back))
        loan.recalling = False
        if self.maxsize > 0 and back:
            self.not_full.notify(len(back))  # a lent item's room is its own again
        return self._serve() if back and self.waiters else []

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
                if self.parked and self.lent and now - self.recalled_at >= _RECALL_RETRY:
                    everyone = True  # a borrower's get waits: as a waiting thread's get does
                if everyone:
                    self.recalled_at = now
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
            if not self.waiters:
                return
            sends = self._serve()
        _deliver(sends)

    def unget(self, data: _Item) -> None:
        """Put back, first in line, an item that its getter did not live to receive."""
        with self.lock:
            self.items.appendleft(data)
            sends = self._serve()
        _deliver(sends)

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


def _get_for(store: Store, sock: socket.socket, block: bool, timeout: float | None) -> _Item:
    """``store.get()`` for a client's plain get; given up if the client dies while it waits.

    A process terminated while blocked in ``get()`` must not take the next item with it.
    """
    try:
        return store.get(False)
    except Empty:
        if not block:
            raise
    end = None if timeout is None else time.monotonic() + timeout
    while True:
        left = _CLIENT_CHECK if end is None else min(_CLIENT_CHECK, end - time.monotonic())
        try:
            item = store.get(True, max(left, 0.0))
        except Empty:
            if end is not None and time.monotonic() >= end:
                raise
            if _peer_gone(sock):
                raise EOFError("the client went away") from None
            continue
        if _peer_gone(sock):
            store.unget(item)
            raise EOFError("the client went away")
        return item


def _answer(batch: list[_Item]) -> tuple[bytes, Any]:
    """The frame, as head and body, that answers a borrower's get with the items lent to it."""
    return (QUEUE_ITEM, batch[0]) if len(batch) == 1 else (encode_queue_batch(batch), b"")


def _send_lent(loan: _Loan, batch: list[_Item]) -> None:
    """Send a borrower the items just lent to it: the answer to its get."""
    with loan.send_lock:
        loan.conn.send_frame(*_answer(batch))


def _deliver(sends: list[tuple[_Loan, list[_Item]]]) -> None:
    """Send what :meth:`Store._serve` lent to borrowers whose gets waited (no lock held).

    The thread that put the item sends it, but never waits on a borrower that does not
    read (stopped, cut off) or on the tail of a big item: what the socket does not take
    at once is sent by a thread of its own, which holds the connection until the frame
    is whole.
    """
    for loan, batch in sends:
        head, body = _answer(batch)
        loan.send_lock.acquire()
        try:
            sock = loan.conn._socket()  # noqa: SLF001 - the owner's side of a Connection, in the same layer: a frame in parts, not waiting
            parts: list[Any] = [frame_header(len(head) + len(body)) + head, body]
            rest = _unsent(parts, sock.sendmsg(parts, (), socket.MSG_DONTWAIT))
        except BlockingIOError:
            rest = parts
        except OSError:
            rest = []  # its connection is ending: its session gives the items back with it
        if not rest:
            loan.send_lock.release()
            continue
        try:
            threading.Thread(target=_send_rest, args=(sock, rest, loan.send_lock),
                             name="fiber-queue-send", daemon=True).start()
        except BaseException:
            loan.send_lock.release()
            raise


def _unsent(parts: list[Any], sent: int) -> list[Any]:
    """What is left of ``parts`` once their first ``sent`` bytes went out."""
    rest = []
    for part in parts:
        if sent >= len(part):
            sent -= len(part)
        else:
            rest.append(memoryview(part)[sent:])
            sent = 0
    return rest


def _send_rest(sock: socket.socket, rest: list[memoryview], send_lock: threading.Lock) -> None:
    """Finish a frame that :func:`_deliver` began, then let others send on its connection."""
    try:
        for part in rest:
            sock.sendall(part)
    except OSError:
        pass  # its connection is ending: its session gives the items back with it
    finally:
        send_lock.release()


class _Session:
    """One client connection of a queue as its owner serves it: a handler per QUEUE_ kind.

    An item sent for a plain get goes back in front if the connection ends before
    its QUEUE_GOT. A borrower's get that finds the queue empty waits in the store
    (:class:`_Parked`) while this thread reads on; a get with a timeout is answered
    QUEUE_EMPTY by this thread when it expires unserved.
    """

    __slots__ = ("store", "sock", "conn", "reader", "send_lock", "loan", "token", "pending",
                 "sent", "parked", "parked_until")

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
        self.parked: _Parked | None = None  # the borrower's get waiting in the store
        self.parked_until: float | None = None  # ... until then (a get with a timeout)

    def run(self) -> None:
        """Answer requests until the client goes away; then give back what it held."""
        handler_of, recv, reader = _HANDLERS.get, self.reader.recv_bytes, self.reader
        try:
            while True:
                msg = self.pending
                if msg is None:
                    if self.parked_until is not None and not reader.buffered():
                        self._expire()
                        continue
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

    def _expire(self) -> None:
        """Wait for input until the parked get's deadline; then answer it if nobody has."""
        parked, until = self.parked, self.parked_until
        assert parked is not None and until is not None
        if not parked.served:
            left = until - time.monotonic()
            if left > 0 and readable(self.sock, left + 0.001):  # (a poll counts whole ms)
                return
            with self.store.lock:
                expired = self.store.unpark(parked)
            if expired:
                with self.send_lock:
                    self.conn.send_frame(QUEUE_EMPTY)
        self.parked = self.parked_until = None

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
        if loan is None:  # a plain get: the client says QUEUE_GOT once it has the item
            try:
                item = _get_for(store, self.sock, block, timeout)
            except Empty:
                conn.send_frame(QUEUE_EMPTY)
                return
            self.sent = item
            conn.send_frame(QUEUE_ITEM, item)
            return
        if self.parked is not None and not self.parked.served:
            raise unexpected(msg, "a borrowing queue connection whose get still waits")
        try:
            lent = store.lend_or_park(loan, window or 1, block and timeout != 0)
        except Empty:
            with self.send_lock:
                conn.send_frame(QUEUE_EMPTY)
            return
        if isinstance(lent, _Parked):
            self.parked = lent
            self.parked_until = None if timeout is None else time.monotonic() + timeout
            return
        _send_lent(loan, lent)

    def on_return(self, msg: Any) -> None:
        loan = self._borrowing(msg)
        n = decode_queue_return(msg)
        with self.store.lock:
            sends = self.store.give_back(loan, n)
        _deliver(sends)

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
        sends: list[tuple[_Loan, list[_Item]]] = []
        if self.loan is not None:
            with store.lock:
                if self.parked is not None:
                    store.unpark(self.parked)
                store.loans.pop(self.token, None)
                sends = store.give_back(self.loan)
                store.recall_wanted.notify()  # without loans, the recaller ends
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # a thread that still sends to it stops
        except OSError:
            pass
        with self.send_lock:  # closed once no other thread sends on it
            self.conn.close()
        _deliver(sends)


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
