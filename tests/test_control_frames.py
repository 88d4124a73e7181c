"""Frames with a control bit (wire/control.py) on real sockets: data and control apart, whole."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from fiber_core.wire.control import CONTROL, U64, control_frame, peek_is_data, read_frame, send_data
from fiber_core.wire.messages import PIPE_CLOSE, PIPE_WANT

_RCVTIMEO_10MS = struct.pack("ll", 0, 10_000)


def _pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair()


def test_data_and_control_frames_come_out_as_they_went_in_and_in_order() -> None:
    a, b = _pair()
    with a, b:
        big = bytes(range(256)) * 1024  # 256 KiB: header and body written apart

        def write() -> None:  # in a thread: the big frame is more than the socket holds
            send_data(a, b"one")
            a.sendall(control_frame(PIPE_WANT, U64.pack(7)))
            send_data(a, b"")
            send_data(a, big)
            a.sendall(control_frame(PIPE_CLOSE))

        t = threading.Thread(target=write)
        t.start()
        assert read_frame(b) == (False, b"one")
        assert read_frame(b) == (True, PIPE_WANT + U64.pack(7))
        assert read_frame(b) == (False, b"")
        assert read_frame(b) == (False, big)
        assert read_frame(b) == (True, PIPE_CLOSE)
        t.join(30)


def test_a_control_frame_has_the_top_bit_of_its_length_set() -> None:
    frame = control_frame(PIPE_WANT, U64.pack(1))
    (n,) = struct.unpack("!I", frame[:4])
    assert n & CONTROL and n & ~CONTROL == 1 + 8


def test_the_end_of_the_connection_is_eoferror_even_inside_a_frame() -> None:
    a, b = _pair()
    with b:
        a.sendall(struct.pack("!I", 10) + b"half")
        a.close()
        with pytest.raises(EOFError):
            read_frame(b)
        with pytest.raises(EOFError):
            read_frame(b)


def test_with_a_receive_timeout_no_frame_is_blockingioerror_and_a_slow_frame_is_read_whole() -> None:
    a, b = _pair()
    with a, b:
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _RCVTIMEO_10MS)
        with pytest.raises(BlockingIOError):
            read_frame(b)
        # A frame whose rest comes after several receive timeouts have passed: the
        # pause is what is tested here, not a way to wait for something.
        a.sendall(struct.pack("!I", 6) + b"ab")

        def rest() -> None:
            time.sleep(0.1)
            a.sendall(b"cdef")

        t = threading.Thread(target=rest)
        t.start()
        assert read_frame(b) == (False, b"abcdef")
        t.join(30)


def test_peek_tells_data_from_control_without_consuming_it() -> None:
    a, b = _pair()
    with b:
        a.sendall(control_frame(PIPE_WANT, U64.pack(0)))
        assert peek_is_data(b) is False
        assert read_frame(b)[0] is True
        send_data(a, b"x")
        assert peek_is_data(b) is True
        assert read_frame(b) == (False, b"x")
        a.close()
        assert peek_is_data(b) is None
