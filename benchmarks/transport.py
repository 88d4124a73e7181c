"""Why Fiber's connections are plain sockets: one-message round trips, transport by transport.

    python benchmarks/transport.py [--pings 2000] [--reps 7] [--pin CPU]

A child process echoes what it receives; the parent times ``pings`` round trips
of a one-byte message and keeps the median. Rounds are interleaved across the
transports, and the table reports the median over ``reps`` rounds:

* ``multiprocessing.Pipe`` (the reference);
* a Fiber ``Pipe`` (``send_bytes``/``recv_bytes``), as Fiber programs use it;
* a bare Unix stream socket with 4-byte length prefixes (what Fiber's frames are);
* nng (pynng) Pair0 over ``ipc://`` and over ``tcp://127.0.0.1`` when pynng is
  installed (``pip install pynng``); pynng is not a dependency of Fiber.

Loopback only: nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import fiber_core

_LEN = struct.Struct("!I")


# -- echo children -----------------------------------------------------------------------


def echo_conn(conn: Any) -> None:
    """Echo ``recv_bytes`` until an empty message (multiprocessing and Fiber pipes)."""
    while msg := conn.recv_bytes():
        conn.send_bytes(msg)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def echo_socket(path: str) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    while True:
        (n,) = _LEN.unpack(_recv_exact(sock, 4))
        if n == 0:
            break
        sock.sendall(_LEN.pack(n) + _recv_exact(sock, n))
    sock.close()


def echo_nng(address: str) -> None:
    import pynng

    with pynng.Pair0(dial=address) as sock:
        while (msg := sock.recv()) != b"stop":  # nng cannot receive an empty message
            sock.send(msg)


# -- transports ----------------------------------------------------------------------------


class Transport:
    """A started echo child and a ``ping()`` that does one round trip."""

    name = ""

    def ping(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


class StdPipe(Transport):
    name = "multiprocessing.Pipe"

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=echo_conn, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    def ping(self) -> None:
        self.conn.send_bytes(b"x")
        self.conn.recv_bytes()

    def stop(self) -> None:
        self.conn.send_bytes(b"")
        _end(self.proc)


class FiberPipe(StdPipe):
    name = "fiber_core.Pipe"

    def __init__(self) -> None:
        self.conn, child = fiber_core.Pipe()
        self.proc = fiber_core.Process(target=echo_conn, args=(child,), daemon=True)
        self.proc.start()


class UnixSocket(Transport):
    name = "Unix socket, length-prefixed"

    def __init__(self, tmp: str) -> None:
        path = os.path.join(tmp, "echo.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        ctx = multiprocessing.get_context("spawn")
        self.proc = ctx.Process(target=echo_socket, args=(path,), daemon=True)
        self.proc.start()
        self.sock, _ = listener.accept()
        listener.close()
        self.msg = _LEN.pack(1) + b"x"

    def ping(self) -> None:
        self.sock.sendall(self.msg)
        (n,) = _LEN.unpack(_recv_exact(self.sock, 4))
        _recv_exact(self.sock, n)

    def stop(self) -> None:
        self.sock.sendall(_LEN.pack(0))
        _end(self.proc)
        self.sock.close()


class NngPair(Transport):
    def __init__(self, address: str, label: str) -> None:
        import pynng

        self.name = f"nng Pair0, {label}"
        self.sock = pynng.Pair0(listen=address)
        ctx = multiprocessing.get_context("spawn")
        self.proc = ctx.Process(target=echo_nng, args=(address,), daemon=True)
        self.proc.start()
        self.sock.send(b"x")  # the first message waits for the child to dial
        self.sock.recv()

    def ping(self) -> None:
        self.sock.send(b"x")
        self.sock.recv()

    def stop(self) -> None:
        self.sock.send(b"stop")
        _end(self.proc)
        self.sock.close()


def _end(proc: Any) -> None:
    """Wait a little for an echo child to finish, then kill it: a stop never hangs."""
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def transports(tmp: str, found: list[Transport]) -> None:
    """Start every transport, appending each to ``found`` once its child runs."""
    found += [StdPipe(), FiberPipe(), UnixSocket(tmp)]
    try:
        import pynng  # noqa: F401
    except ImportError:
        print("pynng is not installed: its rows are left out (pip install pynng)", file=sys.stderr)
        return
    found.append(NngPair(f"ipc://{tmp}/nng.ipc", "ipc://"))
    found.append(NngPair(f"tcp://127.0.0.1:{_free_port()}", "tcp://127.0.0.1"))


def median_rtt_us(ping: Callable[[], None], pings: int) -> float:
    times = []
    for _ in range(pings):
        t0 = time.perf_counter()
        ping()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pings", type=int, default=2000, help="round trips per round")
    parser.add_argument("--reps", type=int, default=7, help="interleaved rounds")
    parser.add_argument("--pin", type=int, metavar="CPU",
                        help="pin this process and its children to one CPU")
    args = parser.parse_args(argv)
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})  # children inherit it

    with tempfile.TemporaryDirectory(prefix="fiber-transport-") as tmp:
        ts: list[Transport] = []
        try:
            transports(tmp, ts)
            for t in ts:  # warm-up
                median_rtt_us(t.ping, 200)
            results: dict[str, list[float]] = {t.name: [] for t in ts}
            for _ in range(args.reps):
                for t in ts:
                    results[t.name].append(median_rtt_us(t.ping, args.pings))
        finally:
            for t in ts:
                t.stop()

    ref = statistics.median(results[StdPipe.name])
    pinned = "" if args.pin is None else f", all pinned to CPU {args.pin}"
    print(f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs{pinned}; one-byte round trips, "
          f"median of {args.pings} per round, median over {args.reps} interleaved rounds.\n")
    print("| transport | round trip (us) | vs multiprocessing.Pipe |")
    print("|---|---:|---:|")
    for name, values in results.items():
        rtt = statistics.median(values)
        print(f"| {name} | {rtt:.1f} | {rtt / ref:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
