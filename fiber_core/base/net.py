"""Socket helpers every layer may use: TCP keepalives that end a connection to a lost peer."""

from __future__ import annotations

import socket


def keepalive(sock: socket.socket, idle: float, interval: float, count: int) -> None:
    """Have the kernel drop a TCP connection whose peer stopped answering.

    Probes start after ``idle`` seconds of silence, every ``interval`` seconds, and
    the connection fails after ``count`` unanswered ones, or once sent data has gone
    unacknowledged for ``idle + interval * count`` seconds. Options this system
    lacks are skipped.
    """
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", max(1, round(idle))),
                        ("TCP_KEEPINTVL", max(1, round(interval))),
                        ("TCP_KEEPCNT", max(1, count)),
                        ("TCP_USER_TIMEOUT", max(1000, round((idle + interval * count) * 1000)))):
        opt = getattr(socket, name, None)
        if opt is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
            except OSError:
                pass
