"""A Pipe's round trip on each of its two paths: direct, and through the pipe's creator.

    python benchmarks/pipe_paths.py [--pings 1000] [--reps 5]

A one-byte message goes to an echoing child and back, ``pings`` times a round;
the table gives the median round trip of each round, then the median over
``reps`` interleaved rounds (the order of the rows flips every round):

* ``multiprocessing.Pipe``, parent and child (the reference);
* a Fiber ``Pipe``, parent and child: the parent created the pipe and talks to
  the child's copy directly on its connection (the usual case);
* ``multiprocessing.Pipe``, two children (the parent made it and closed its ends);
* a Fiber ``Pipe``, two children: both ends are copies, so every message goes
  through the creator (the parent), which queues it and hands it to the reader
  when it asks (PIPE_WANT). This is the path of the creator's state machine.

Loopback only: nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import fiber_core


def echo(conn: Any) -> None:
    while msg := conn.recv_bytes():
        conn.send_bytes(msg)


def timed_pings(conn: Any, pings: int) -> float:
    """The median round trip in microseconds; ends the echo after."""
    times = []
    for _ in range(pings):
        t = time.perf_counter()
        conn.send_bytes(b"x")
        conn.recv_bytes()
        times.append(time.perf_counter() - t)
    conn.send_bytes(b"")
    return statistics.median(times) * 1e6


def pinger(conn: Any, pings: int, out: Any) -> None:
    out.send(timed_pings(conn, pings))


def parent_and_child(lib: Any, pings: int) -> float:
    here, there = lib.Pipe()
    p = lib.Process(target=echo, args=(there,))
    p.start()
    there.close()
    result = timed_pings(here, pings)
    p.join()
    here.close()
    return result


def two_children(lib: Any, pings: int) -> float:
    a, b = lib.Pipe()
    result_r, result_w = lib.Pipe(duplex=False)
    ps = [lib.Process(target=echo, args=(b,)), lib.Process(target=pinger, args=(a, pings, result_w))]
    for p in ps:
        p.start()
    a.close()
    b.close()
    result_w.close()
    result = float(result_r.recv())
    for p in ps:
        p.join()
    result_r.close()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pings", type=int, default=1000, help="round trips per round")
    parser.add_argument("--reps", type=int, default=5, help="interleaved rounds")
    args = parser.parse_args(argv)
    mp = multiprocessing.get_context("spawn")
    rows: list[tuple[str, Callable[[], float]]] = [
        ("multiprocessing.Pipe, parent and child", lambda: parent_and_child(mp, args.pings)),
        ("fiber_core.Pipe, parent and child (direct)", lambda: parent_and_child(fiber_core, args.pings)),
        ("multiprocessing.Pipe, two children", lambda: two_children(mp, args.pings)),
        ("fiber_core.Pipe, two children (through the creator)",
         lambda: two_children(fiber_core, args.pings)),
    ]
    results: dict[str, list[float]] = {name: [] for name, _ in rows}
    for rep in range(args.reps):
        for name, run in rows if rep % 2 == 0 else reversed(rows):
            results[name].append(run())
    print(f"Python {sys.version.split()[0]}; one-byte round trips, median of {args.pings} "
          f"per round, median over {args.reps} interleaved rounds.\n")
    print("| path | round trip (us) |\n|---|---:|")
    for name, _ in rows:
        print(f"| {name} | {statistics.median(results[name]):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
