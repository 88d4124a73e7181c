"""Length-prefixed frames on a socket: :class:`Connection`, :class:`FrameReader`, :func:`wait`.

A frame is a 4-byte big-endian length and that many bytes; a frame of 4 GiB or
more has the length ``0xFFFFFFFF`` followed by an 8-byte length. What a frame
holds is :mod:`fiber_core.wire.messages`' business (or, for a Pipe, the user's).
"""

from __future__ import annotations

import selectors
import socket
import struct
from collections.abc import Iterable

from fiber_core.base.errors import BufferTooShort
from fiber_core.wire.serialize import _SMALL, dumps, loads

TYPE_CHECKING = False  # typing's own, without importing typing: a job starts without it
if TYPE_CHECKING:
    from typing import Any

_HEADER = struct.Struct("!I")


_BIG = 0xFFFFFFFF


_BIG_HEADER = struct.Struct("!Q")


_WAITALL = getattr(socket, "MSG_WAITALL", 0)


def framed(payload: bytes) -> bytes:
    """``payload`` as one frame, header included (to write several in one call)."""
    return _HEADER.pack(len(payload)) + payload


def frame_header(n: int) -> bytes:
    """The header of a frame of ``n`` bytes (for a frame written in parts)."""
    return _HEADER.pack(_BIG) + _BIG_HEADER.pack(n) if n >= _BIG else _HEADER.pack(n)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    # Usually one syscall and no copy: the kernel waits until all n bytes are there.
    data = sock.recv(n, _WAITALL)
    if len(data) == n:
        return data
    if not data:
        raise EOFError("connection closed by the other process")
    # A short read (a signal, a socket with a timeout): fill in the rest.
    buf = bytearray(n)
    view = memoryview(buf)
    got = len(data)
    view[:got] = data
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("connection closed by the other process")
        got += k
    return bytes(buf)


class Connection:
    """A message connection with the API of :class:`multiprocessing.connection.Connection`."""

    def __init__(self, sock: socket.socket | None, readable: bool = True, writable: bool = True) -> None:
        self._sock = sock
        self._readable = readable
        self._writable = writable
        self._closed = False

    # Subclasses that connect lazily override this.
    def _socket(self) -> socket.socket:
        if self._closed or self._sock is None:
            raise OSError("handle is closed")
        return self._sock

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def readable(self) -> bool:
        return self._readable

    @property
    def writable(self) -> bool:
        return self._writable

    def fileno(self) -> int:
        return self._socket().fileno()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._sock is not None:
                try:
                    self._sock.close()
                finally:
                    self._sock = None

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_writable(self) -> None:
        if not self._writable:
            raise OSError("connection is read-only")

    def _check_readable(self) -> None:
        if not self._readable:
            raise OSError("connection is write-only")

    # The checks are written out in the four calls below: a call less on each message.

    def send_bytes(self, buf: Any, offset: int = 0, size: int | None = None) -> None:
        if not self._writable:
            raise OSError("connection is read-only")
        if type(buf) is bytes and offset == 0 and size is None:  # the usual case
            self._send(buf)
            return
        view = memoryview(buf).cast("B")
        n = len(view)
        if offset < 0 or offset > n:
            raise ValueError("offset is out of bounds")
        if size is None:
            size = n - offset
        if size < 0 or offset + size > n:
            raise ValueError("size is out of bounds")
        self._send(view[offset:offset + size])

    def _send(self, data: bytes | bytearray | memoryview) -> None:
        """Send one message of the program's own (``send``, ``send_bytes``); a Pipe end
        that routes its messages elsewhere overrides it."""
        self.send_frame(b"", data)

    def send_frame(self, head: bytes, body: bytes | bytearray | memoryview = b"") -> None:
        """Send one frame of ``head + body``, a message's head and body (a big ``body``
        is not copied). For Fiber's own connections: a Pipe's user has ``send_bytes``."""
        sock = self._socket()
        n = len(head) + len(body)
        header = _HEADER.pack(n) if n < _BIG else frame_header(n)  # (no call for the usual)
        if n <= _SMALL:
            sock.sendall(header + head + body)
        else:
            sock.sendall(header + head)
            sock.sendall(body)

    def _recv(self, maxlength: int | None = None) -> bytes:
        sock = self._socket()
        (n,) = _HEADER.unpack(_recv_exact(sock, 4))
        if n == _BIG:
            (n,) = _BIG_HEADER.unpack(_recv_exact(sock, 8))
        if maxlength is not None and n > maxlength:
            self.close()
            raise OSError("bad message length")
        return _recv_exact(sock, n) if n else b""

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        if not self._readable:
            raise OSError("connection is write-only")
        if maxlength is not None and maxlength < 0:
            raise ValueError("negative maxlength")
        return self._recv(maxlength)

    def recv_bytes_into(self, buf: Any, offset: int = 0) -> int:
        self._check_readable()
        data = self._recv()
        view = memoryview(buf).cast("B")
        if offset < 0 or offset > len(view):
            raise ValueError("negative offset" if offset < 0 else "offset too large")
        if len(data) > len(view) - offset:
            raise BufferTooShort(data)
        view[offset:offset + len(data)] = data
        return len(data)

    def send(self, obj: Any) -> None:
        if not self._writable:
            raise OSError("connection is read-only")
        self._send(dumps(obj))

    def recv(self) -> Any:
        if not self._readable:
            raise OSError("connection is write-only")
        return loads(self._recv())

    def poll(self, timeout: float | None = 0.0) -> bool:
        self._check_readable()
        return bool(wait([self], timeout))


class FrameReader:
    """Reads the frames of a :class:`Connection`'s peer with as few syscalls as it can.

    It reads ahead, so several small frames usually come out of one ``recv``. The
    socket's readiness then no longer tells whether a frame is waiting: use it only
    for a socket that nothing polls, such as one a thread serves until EOF.
    """

    def __init__(self, sock: socket.socket, chunk: int = _SMALL) -> None:
        self._sock = sock
        self._chunk = chunk
        self._buf = b""
        self._pos = 0

    def buffered(self) -> bool:
        """Whether a whole frame is already here (``recv_bytes`` will not block)."""
        buf, pos = self._buf, self._pos
        if len(buf) - pos < 4:
            return False
        (n,) = _HEADER.unpack_from(buf, pos)
        return n != _BIG and pos + 4 + n <= len(buf)

    def recv_bytes(self) -> bytes | bytearray:
        """The next frame: ``bytes``, or for a frame bigger than ``chunk``, a ``bytearray``."""
        buf, pos = self._buf, self._pos
        while True:
            avail = len(buf) - pos
            if avail >= 4:
                (n,) = _HEADER.unpack_from(buf, pos)
                start = pos + 4
                if n == _BIG:
                    if avail >= 12:
                        (n,) = _BIG_HEADER.unpack_from(buf, start)
                        start += 8
                    else:
                        n = -1
                if n >= 0:
                    end = start + n
                    if end <= len(buf):
                        self._buf, self._pos = buf, end
                        return buf[start:end]
                    if n > self._chunk:  # a big frame: the rest straight into place, no copies
                        self._buf, self._pos = b"", 0
                        return self._recv_big(buf[start:], n)
            chunk = self._sock.recv(self._chunk)
            if not chunk:
                self._buf, self._pos = b"", 0
                raise EOFError("connection closed by the other process")
            buf = buf[pos:] + chunk if pos < len(buf) else chunk
            pos = 0

    def _recv_big(self, head: bytes, n: int) -> bytearray:
        data = bytearray(n)
        got = len(head)
        data[:got] = head
        view = memoryview(data)
        while got < n:
            k = self._sock.recv_into(view[got:], n - got, _WAITALL)
            if k == 0:
                raise EOFError("connection closed by the other process")
            got += k
        return data


def wait(object_list: Iterable[Any], timeout: float | None = None) -> list[Any]:
    """Like :func:`multiprocessing.connection.wait`: the objects that are ready to read.

    Accepts Fiber connections, sockets, file descriptors and objects with ``fileno()``.
    """
    objects = list(object_list)
    with selectors.DefaultSelector() as sel:
        for obj in objects:
            sel.register(obj, selectors.EVENT_READ)
        ready = sel.select(timeout)
    return [key.fileobj for key, _ in ready]
