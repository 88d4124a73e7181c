"""Socket helpers every layer may use: TCP connections, and keepalives that end a connection to a lost peer."""

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


def connect_tcp(host: str, port: int, timeout: float | None) -> socket.socket:
    """A TCP connection to ``host``:``port``, as :func:`socket.create_connection` makes.

    A numeric address is connected to directly: ``create_connection`` asks the
    resolver even for one, which costs about 2 ms in a container, on the start
    path of every job.
    """
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect((host, port))
        except BaseException:
            sock.close()
            raise
        return sock
    return socket.create_connection((host, port), timeout=timeout)
