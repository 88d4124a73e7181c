"""``Queue``, ``SimpleQueue`` and ``JoinableQueue`` for the processes of a run.

A queue lives in the process that created it (its *owner*). The owner reads and
writes it in memory; every other process, on any host, holds a handle that talks
to the owner over one authenticated connection per thread. Items travel as
pickled bytes and are unpickled only by the process that gets them. A queue
works as long as its owner runs, which for the usual program (the main process
creates the queues) is the whole run.
"""

from __future__ import annotations

import queue as _stdqueue
import select
import socket
import struct
import threading
import time
import uuid
from collections import deque
from typing import Any

from fiber_core.connection import Connection, FrameReader, dial, dumps, loads
from fiber_core.errors import FiberError

Empty = _stdqueue.Empty
Full = _stdqueue.Full

_F = struct.Struct("!d")
_Q = struct.Struct("!q")
_CLIENT_CHECK = 0.2  # seconds between checks that a client blocked in get() still lives
_BLOCK = b"\x01" + _F.pack(-1.0)
_NOBLOCK = b"\x00" + _F.pack(-1.0)


class _Store:
    """The owner's in-memory queue: pickled items, with the stdlib's blocking rules."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self.items: deque[bytes] = deque()
        self.lock = threading.Lock()
        self.not_empty = threading.Condition(self.lock)
        self.not_full = threading.Condition(self.lock)
        self.all_done = threading.Condition(self.lock)
        self.unfinished = 0

    def put(self, data: bytes, block: bool = True, timeout: float | None = None) -> None:
        with self.not_full:
            if self.maxsize > 0:
                if not block:
                    if len(self.items) >= self.maxsize:
                        raise Full
                elif timeout is None:
                    while len(self.items) >= self.maxsize:
                        self.not_full.wait()
                else:
                    if timeout < 0:
                        raise ValueError("'timeout' must be a non-negative number")
                    end = time.monotonic() + timeout
                    while len(self.items) >= self.maxsize:
                        left = end - time.monotonic()
                        if left <= 0:
                            raise Full
                        self.not_full.wait(left)
            self.items.append(data)
            self.unfinished += 1
            self.not_empty.notify()

    def get(self, block: bool = True, timeout: float | None = None) -> bytes:
        with self.not_empty:
            if not block:
                if not self.items:
                    raise Empty
            elif timeout is None:
                while not self.items:
                    self.not_empty.wait()
            else:
                if timeout < 0:
                    raise ValueError("'timeout' must be a non-negative number")
                end = time.monotonic() + timeout
                while not self.items:
                    left = end - time.monotonic()
                    if left <= 0:
                        raise Empty
                    self.not_empty.wait(left)
            data = self.items.popleft()
            self.not_full.notify()
            return data

    def put_many(self, items: list[bytes]) -> None:
        """Append ``items`` to an unbounded queue (which never blocks)."""
        with self.lock:
            self.items.extend(items)
            self.unfinished += len(items)
            self.not_empty.notify(len(items))

    def unget(self, data: bytes) -> None:
        """Put back, first in line, an item that its getter did not live to receive."""
        with self.lock:
            self.items.appendleft(data)
            self.not_empty.notify()

    def qsize(self) -> int:
        with self.lock:
            return len(self.items)

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


def _peer_gone(sock: socket.socket) -> bool:
    """Whether the client closed ``sock`` (it sends nothing while it waits for a reply)."""
    try:
        ready, _, _ = select.select([sock], [], [], 0)
        return bool(ready) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _get_for(store: _Store, sock: socket.socket, block: bool, timeout: float | None) -> bytes:
    """``store.get()`` for a client; given up if the client dies while it waits.

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


def _item(msg: bytes | bytearray) -> bytes | memoryview:
    """The item in a put request; a big one is not copied."""
    return msg[10:] if len(msg) <= 65536 else memoryview(msg)[10:]


def _serve(store: _Store, sock: socket.socket) -> None:
    """Serve one client connection of a queue, in the hub thread that accepted it.

    Requests: ``p`` put (reply only for bounded queues), ``g`` get, ``s`` size,
    ``d`` task_done, ``j`` join. Replies: ``k`` ok, ``i`` item, ``E`` empty,
    ``F`` full, ``V`` ValueError.
    """
    conn = Connection(sock)
    reader = FrameReader(sock)  # a client's puts are not answered: read them in batches
    pending = None  # a request read ahead
    try:
        while True:
            msg, pending = reader.recv_bytes() if pending is None else pending, None
            op = msg[:1]
            if op == b"p" and store.maxsize <= 0:
                # Unbounded: a put neither blocks nor gets a reply, so store at once
                # all the puts that came in together.
                items = [_item(msg)]
                while reader.buffered():
                    msg = reader.recv_bytes()
                    if msg[:1] != b"p":
                        pending = msg
                        break
                    items.append(msg[10:])
                store.put_many(items)
                continue
            if op == b"p":
                block, timeout = msg[1] == 1, _F.unpack_from(msg, 2)[0]
                try:
                    store.put(_item(msg), block, None if timeout < 0 else timeout)
                    reply = b"k"
                except Full:
                    reply = b"F"
                if store.maxsize > 0:
                    conn.send_bytes(reply)
            elif op == b"g":
                block, timeout = msg[1] == 1, _F.unpack_from(msg, 2)[0]
                try:
                    item = _get_for(store, sock, block, None if timeout < 0 else timeout)
                except Empty:
                    conn.send_bytes(b"E")
                    continue
                try:
                    conn._send(item, b"i")
                except OSError:
                    store.unget(item)
                    raise
            elif op == b"s":
                conn.send_bytes(b"k" + _Q.pack(store.qsize()))
            elif op == b"d":
                try:
                    store.task_done()
                    conn.send_bytes(b"k")
                except ValueError:
                    conn.send_bytes(b"V")
            elif op == b"j":
                store.join()
                conn.send_bytes(b"k")
    except (EOFError, OSError):
        pass
    finally:
        conn.close()


class Queue:
    """A process-shared FIFO queue, like :class:`multiprocessing.Queue`.

    ``qsize()`` works on every platform. There is no feeder thread: ``put``
    pickles at once and, for unbounded queues, returns when the item is handed
    to the operating system, so ``close()`` and ``join_thread()`` have nothing to
    wait for.
    """

    def __init__(self, maxsize: int = 0, *, ctx: Any = None) -> None:
        from fiber_core.runtime import runtime

        if maxsize < 0:
            maxsize = 0
        self._maxsize = maxsize
        self._id = uuid.uuid4().hex
        self._store: _Store | None = _Store(maxsize)
        hub = runtime().hub
        hub.register(f"queue:{self._id}", lambda target, sock, s=self._store: _serve(s, sock))
        self._hub = hub.addresses
        self._after_init()

    def _after_init(self) -> None:
        self._closed = False
        self._local = threading.local()

    def __getstate__(self) -> dict:
        from fiber_core.runtime import outgoing_addresses

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
            from fiber_core.runtime import runtime

            try:
                sock = dial(self._hub, runtime().authkey, f"queue:{self._id}")
            except ConnectionError as e:
                raise FiberError(f"the process that created this queue is unreachable: {e}") from e
            conn = self._local.conn = Connection(sock)
        return conn

    def _call(self, request: bytes) -> bytes:
        conn = self._conn()
        try:
            conn.send_bytes(request)
            return conn.recv_bytes()
        except (EOFError, OSError) as e:
            self._local.conn = None
            raise FiberError("the process that created this queue has exited") from e

    @staticmethod
    def _args(block: bool, timeout: float | None) -> bytes:
        if timeout is None:
            return _BLOCK if block else _NOBLOCK
        if timeout < 0:
            raise ValueError("'timeout' must be a non-negative number")
        return bytes([1 if block else 0]) + _F.pack(timeout)

    # -- the multiprocessing.Queue API ----------------------------------------------

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        data = dumps(obj)
        if self._store is not None:
            self._store.put(data, block, timeout)
            return
        args = self._args(block, timeout)
        if self._maxsize > 0:
            if self._call(b"p" + args + data) == b"F":
                raise Full
            return
        try:
            self._conn()._send(data, b"p" + args)
        except OSError as e:
            self._local.conn = None
            raise FiberError("the process that created this queue has exited") from e

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        if self._store is not None:
            return loads(self._store.get(block, timeout))
        reply = self._call(b"g" + self._args(block, timeout))
        if reply[:1] == b"E":
            raise Empty
        return loads(memoryview(reply)[1:])

    def put_nowait(self, obj: Any) -> None:
        self.put(obj, False)

    def get_nowait(self) -> Any:
        return self.get(False)

    def qsize(self) -> int:
        if self._store is not None:
            return self._store.qsize()
        return _Q.unpack_from(self._call(b"s"), 1)[0]

    def empty(self) -> bool:
        return self.qsize() == 0

    def full(self) -> bool:
        return self._maxsize > 0 and self.qsize() >= self._maxsize

    def close(self) -> None:
        self._closed = True
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

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
        elif self._call(b"d") == b"V":
            raise ValueError("task_done() called too many times")

    def join(self) -> None:
        if self._store is not None:
            self._store.join()
        else:
            self._call(b"j")


class SimpleQueue(Queue):
    """An unbounded queue with ``get``, ``put``, ``empty`` and ``close``."""

    def __init__(self, *, ctx: Any = None) -> None:
        super().__init__(0)
