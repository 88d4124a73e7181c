"""A Pipe's round trip and one-way rate on each of its two paths: direct, and through the creator.

    python benchmarks/pipe_paths.py [--pings 1000] [--reps 5]
    python benchmarks/pipe_paths.py --against /path/to/other/checkout [--reps 7]

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

And the one-way rate of 16-byte messages (``send_bytes``, ``messages`` a round; the clock
stops when the reader says it has the last), on both Fiber paths: parent to child (the
creator writes, the child's copy reads and acknowledges) and from one child to another.

``--against DIR`` runs the Fiber rows in fresh interpreters, with ``PYTHONPATH=DIR`` and
with this tree's root, alternating (the order flips every round), and prints the median
of each row for both trees and their ratio.

Loopback only: nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
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


def drain(conn: Any, n: int, done: Any) -> None:
    for _ in range(100):
        conn.recv_bytes()
    done.send_bytes(b"ready")
    for _ in range(n):
        conn.recv_bytes()
    done.send_bytes(b"ok")


def flood(conn: Any, n: int) -> None:
    for _ in range(n):
        conn.send_bytes(b"x" * 16)


def one_way_from_parent(lib: Any, n: int) -> float:
    """Messages per second from the creator to a child's copy."""
    here, there = lib.Pipe()
    done_r, done_w = lib.Pipe(duplex=False)
    p = lib.Process(target=drain, args=(there, n, done_w))
    p.start()
    there.close()
    done_w.close()
    flood(here, 100)
    done_r.recv_bytes()  # the child connected and reading
    t = time.perf_counter()
    flood(here, n)
    done_r.recv_bytes()
    rate = n / (time.perf_counter() - t)
    p.join()
    here.close()
    return rate


def timed_flood(conn: Any, n: int, go: Any) -> None:
    flood(conn, 100)
    go.recv_bytes()  # the reader has the first 100
    flood(conn, n)


def one_way_between_children(lib: Any, n: int) -> float:
    """Messages per second from one child's copy to another's, through the creator."""
    a, b = lib.Pipe()
    go_r, go_w = lib.Pipe(duplex=False)
    done_r, done_w = lib.Pipe(duplex=False)
    ps = [lib.Process(target=drain, args=(b, n, done_w)),
          lib.Process(target=timed_flood, args=(a, n, go_r))]
    for p in ps:
        p.start()
    for end in (a, b, go_r, done_w):
        end.close()
    done_r.recv_bytes()  # the reader has the first 100
    t = time.perf_counter()
    go_w.send_bytes(b"go")
    done_r.recv_bytes()
    rate = n / (time.perf_counter() - t)
    for p in ps:
        p.join()
    return rate


def fiber_rows(pings: int, messages: int) -> list[tuple[str, str, Callable[[], float]]]:
    return [
        ("round trip, parent and child (direct)", "us", lambda: parent_and_child(fiber_core, pings)),
        ("round trip, two children (through the creator)", "us",
         lambda: two_children(fiber_core, pings)),
        ("one way, parent -> child (direct)", "msg/s",
         lambda: one_way_from_parent(fiber_core, messages)),
        ("one way, child -> child (through the creator)", "msg/s",
         lambda: one_way_between_children(fiber_core, messages // 10)),
    ]


def compare(other: str, reps: int, pings: int, messages: int) -> None:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"other": os.path.abspath(other), "this": here}
    results: dict[str, dict[str, list[float]]] = {}
    units: dict[str, str] = {}
    for r in range(reps):
        for name in (("other", "this") if r % 2 == 0 else ("this", "other")):
            env = {**os.environ, "PYTHONPATH": trees[name]}
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--once", "--pings",
                                   str(pings), "--messages", str(messages)],
                                  env=env, cwd=trees[name], check=True, capture_output=True,
                                  text=True, timeout=600)
            for label, (value, unit) in json.loads(proc.stdout.splitlines()[-1]).items():
                results.setdefault(label, {"other": [], "this": []})[name].append(value)
                units[label] = unit
        print(f"round {r + 1}/{reps} (load average {os.getloadavg()[0]:.2f})", file=sys.stderr)
    print(f"this = {trees['this']}, other = {trees['other']}; medians over {reps} interleaved "
          f"rounds (min-max in brackets)\n")
    print("| path | other | this | this / other |\n|---|---:|---:|---:|")
    for label, by in results.items():
        unit = units[label]
        a, b = statistics.median(by["other"]), statistics.median(by["this"])
        better = "higher" if unit == "msg/s" else "lower"
        span = [f"{min(v):,.1f}-{max(v):,.1f}" for v in (by["other"], by["this"])]
        print(f"| {label} ({unit}, {better} is better) | {a:,.1f} [{span[0]}] "
              f"| {b:,.1f} [{span[1]}] | {b / a:.3f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pings", type=int, default=1000, help="round trips per round")
    parser.add_argument("--reps", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--messages", type=int, default=50000, help="one-way messages per round")
    parser.add_argument("--against", metavar="DIR", help="another tree to compare the Fiber rows with")
    parser.add_argument("--once", action="store_true", help="one round of the Fiber rows, as JSON")
    args = parser.parse_args(argv)
    if args.against:
        compare(args.against, args.reps, args.pings, args.messages)
        return 0
    if args.once:
        print(json.dumps({label: (run(), unit)
                          for label, unit, run in fiber_rows(args.pings, args.messages)}))
        return 0
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
