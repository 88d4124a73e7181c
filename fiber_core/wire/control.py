"""Frames with a control bit: a program's messages and a protocol's own on one connection.

A Pipe's copy and its creator talk on one socket that carries both the messages of
the program (*data frames*: the frames of :mod:`fiber_core.wire.framing`, a 4-byte
length, or ``0xFFFFFFFF`` and an 8-byte length from 2 GiB on) and their own
(*control frames*). A control frame has the top bit of its 4-byte length set
(:data:`CONTROL`); its body is one kind byte (``PIPE_*`` of
:mod:`fiber_core.wire.messages`) and its fields.

One write path (:func:`send_data`, and :func:`control_frame` for the bytes of a
control frame) and one read path (:func:`read_frame`, with :func:`peek_is_data`
for a poll that must not consume).
"""

from __future__ import annotations

import socket
import struct

from fiber_core.wire.framing import _BIG, _BIG_HEADER, _HEADER, _WAITALL
from fiber_core.wire.serialize import _SMALL

CONTROL = 0x80000000  # top bit of a 4-byte length: a control frame

U64 = struct.Struct("!Q")  # a control frame's ``Q`` field (a count)

ACK = struct.Struct("!QQ")  # PIPE_ACK's two counts: received, taken


def control_frame(kind: bytes, body: bytes = b"") -> bytes:
    """The bytes of one control frame of ``kind`` (a ``PIPE_*`` code) and ``body``."""
    return _HEADER.pack(CONTROL | (1 + len(body))) + kind + body


def send_data(sock: socket.socket, data: bytes | bytearray | memoryview) -> None:
    """Write one data frame holding ``data`` (a big ``data`` is not copied)."""
    n = len(data)
    if n <= _SMALL:
        sock.sendall(_HEADER.pack(n) + data)
        return
    sock.sendall(_HEADER.pack(n) if n < CONTROL else _HEADER.pack(_BIG) + _BIG_HEADER.pack(n))
    sock.sendall(data)


def _rest(sock: socket.socket, n: int, got: bytes = b"") -> bytes:
    """Read until ``n`` bytes are there (``got`` included), through receive timeouts."""
    parts = [got] if got else []
    need = n - len(got)
    while need:
        try:
            chunk = sock.recv(need, _WAITALL)
        except BlockingIOError:
            continue  # the socket's receive timeout: the rest of the frame is on its way
        if not chunk:
            raise EOFError("connection closed by the other process")
        parts.append(chunk)
        need -= len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def read_frame(sock: socket.socket) -> tuple[bool, bytes]:
    """The next frame: (is it a control frame, its body).

    ``EOFError`` at the end of the connection. On a socket with a receive timeout
    (``SO_RCVTIMEO``), ``BlockingIOError`` when no frame began in time; a frame that
    began is always read whole.
    """
    head = sock.recv(4, _WAITALL)
    if len(head) != 4:
        if not head:
            raise EOFError("connection closed by the other process")
        head = _rest(sock, 4, head)
    (n,) = _HEADER.unpack(head)
    if n < CONTROL:  # the usual case: a message of the program
        if not n:
            return False, b""
        try:
            data = sock.recv(n, _WAITALL)
        except BlockingIOError:
            data = b""
        return False, data if len(data) == n else _rest(sock, n, data)
    if n == _BIG:
        (n,) = _BIG_HEADER.unpack(_rest(sock, 8))
        return False, _rest(sock, n)
    return True, _rest(sock, n & ~CONTROL)


def peek_is_data(sock: socket.socket) -> bool | None:
    """Whether the frame waiting on ``sock`` is a data frame (None: end of file)."""
    head = sock.recv(4, socket.MSG_PEEK)
    if not head:
        return None
    if len(head) < 4:
        return True  # a frame is on its way; a reader will wait for the rest
    (n,) = _HEADER.unpack(head)
    return n == _BIG or not n & CONTROL
