"""Connection setup: how long a dial to a hub takes, handshake included, over Unix and TCP.

    python benchmarks/connect.py [--dials 300] [--reps 9]

This process's hub gets a route that closes each connection it is handed; each round dials
it ``dials`` times over its Unix socket and as many over TCP (127.0.0.1), the two kinds in
an order that flips every round, and the table reports, per kind, the median over rounds of
each round's median dial (``fiber_core.runtime.hub.dial``: connect, the HMAC handshake, the
hub's accept, its handshake thread and the route). What a job, a queue handle or a pipe
copy pays each time it reaches another process of the run. Loopback only.
"""

from __future__ import annotations

import argparse
import platform
import socket
import statistics
import time

from fiber_core.runtime.hub import dial
from fiber_core.runtime.run import runtime


def _close(target: str, sock: socket.socket) -> None:
    sock.close()


def one_round(addresses: dict[str, str], key: bytes, dials: int, order: list[str]) -> dict[str, float]:
    """The median dial (us) of each kind in ``order``, ``dials`` dials each."""
    medians = {}
    for kind in order:
        times = []
        for _ in range(dials):
            t0 = time.perf_counter()
            sock = dial(addresses[kind], key, "bench:connect", timeout=30.0)
            times.append(time.perf_counter() - t0)
            sock.close()
        medians[kind] = statistics.median(times) * 1e6
    return medians


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dials", type=int, default=300, help="dials per kind and round")
    parser.add_argument("--reps", type=int, default=9, help="interleaved rounds")
    args = parser.parse_args(argv)
    rt = runtime()
    rt.hub.register("bench:connect", _close)
    parts = dict(a.split(":", 1) for a in rt.hub.addresses_for("127.0.0.1").split(","))
    addresses = {kind: f"{kind}:{rest}" for kind, rest in parts.items()}
    kinds = sorted(addresses)
    one_round(addresses, rt.authkey, 20, kinds)  # warm up
    results: dict[str, list[float]] = {kind: [] for kind in kinds}
    for rep in range(args.reps):
        order = kinds if rep % 2 == 0 else kinds[::-1]
        for kind, us in one_round(addresses, rt.authkey, args.dials, order).items():
            results[kind].append(us)
    print(f"Python {platform.python_version()}; median dial of {args.dials} per round, "
          f"median over {args.reps} interleaved rounds.\n")
    print("| address | dial, handshake included (us) |")
    print("|---|---:|")
    for kind in kinds:
        print(f"| {kind} | {statistics.median(results[kind]):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
