"""Fiber against the stdlib ``multiprocessing`` (spawn): start latency, Pipe, Queue.

Both libraries are measured in the same run, in alternating rounds (the order
flips every round), and every figure is the median over the rounds. What is
measured:

1. Process start. *start -> first instruction*: the parent reads the clock just
   before ``Process.start()``; the first line of the child's target reads it
   again and sends the value home (the time the value then takes to travel is
   not counted). *start() returns*: how long ``start()`` blocks the caller.
   *start -> join*: ``start()`` then ``join()`` of a no-op target.
2. Pipe round trip. A child echoes what it receives; the parent times each
   round trip of a small object (``send``/``recv``) and of 16 bytes
   (``send_bytes``/``recv_bytes``); the median round trip of each round, then
   the median over the rounds.
3. Queue throughput. A long-lived child produces into (or consumes from) a
   queue whose consumer (or producer) is the parent: messages/s for a small
   tuple, MB/s for 1 MiB bytes objects. The clock runs from the command to the
   child until the last item is in the parent (or the child says it took the
   last one), so the pipeline's fill and drain are counted. And the Queue's
   round trip: the parent puts a small tuple into one queue, a child gets it and
   puts it into a second, the parent gets it from there (both queues made by the
   parent); the median round trip of each round, then the median over the rounds.

Usage::

    python benchmarks/core.py            # about 1-2 minutes
    python benchmarks/core.py --quick    # smoke run, under 20 s
    python benchmarks/core.py --pin 0    # every process on CPU 0
    python benchmarks/core.py --apart 0,1   # this process on CPU 0, the children on CPU 1
    python benchmarks/core.py --breakdown   # where Fiber's Queue round trip goes

The fiber side uses the configured backend (``FIBER_BACKEND``, default
``local``). Only stdlib modules are imported at the top of this file, because
the children of both libraries import it again (as ``__mp_main__``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

SMALL_OBJ = ("msg", 42, 3.14)
SMALL_BYTES = b"x" * 16
MIB = 1 << 20


# -- what the children run (module level: spawn needs to import them) -------------


def child_first_instruction(q: Any) -> None:
    t = time.time()
    q.put(t)


def child_noop() -> None:
    pass


def child_echo(conn: Any) -> None:
    """Echo ``n`` messages per command ``(mode, n)``; stop on ``None``."""
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        mode, n = cmd
        if mode == "obj":
            for _ in range(n):
                conn.send(conn.recv())
        else:
            for _ in range(n):
                conn.send_bytes(conn.recv_bytes())
        conn.send("done")
    conn.close()


def child_queue(ctrl: Any, data: Any, done: Any) -> None:
    """Produce into or consume from ``data`` per command ``(kind, n, size)``; stop on ``None``."""
    while True:
        cmd = ctrl.get()
        if cmd is None:
            break
        kind, n, size = cmd
        if kind == "produce":
            item = payload(size)
            for _ in range(n):
                data.put(item)
        else:
            for _ in range(n):
                data.get()
            done.put("done")


def child_queue_echo(into: Any, back: Any, cpu: int | None = None) -> None:
    """Put back every item of ``into``; stop on ``None``. On ``cpu`` only, if given."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    while (item := into.get()) is not None:
        back.put(item)


def payload(size: int) -> Any:
    return SMALL_OBJ if size == 0 else bytes(size)


# -- the two libraries ------------------------------------------------------------


class Lib:
    """One library under test: its Process, Pipe and Queue factories."""

    def __init__(self, name: str, module: Any) -> None:
        self.name = name
        self.Process = module.Process
        self.Pipe = module.Pipe
        self.Queue = module.Queue


def libraries() -> list[Lib]:
    import fiber_core

    return [Lib("fiber", fiber_core), Lib("multiprocessing", multiprocessing.get_context("spawn"))]


def rounds(libs: list[Lib], n: int) -> Any:
    """Yield ``(round, lib)`` pairs, alternating which library goes first."""
    for r in range(n):
        for lib in (libs if r % 2 == 0 else libs[::-1]):
            yield r, lib


# -- 1. process start ----------------------------------------------------------------


def bench_start(libs: list[Lib], reps: int, results: dict) -> None:
    for lib in libs:  # warm-up: fiber's listener and backend, the OS page cache
        q = lib.Queue()
        p = lib.Process(target=child_first_instruction, args=(q,))
        p.start()
        q.get()
        p.join()
    for _, lib in rounds(libs, reps):
        q = lib.Queue()
        p = lib.Process(target=child_first_instruction, args=(q,))
        t0 = time.time()
        p.start()
        t1 = time.time()
        first = q.get()
        p.join()
        results[("start -> first instruction", "ms")][lib.name].append((first - t0) * 1e3)
        results[("start() returns", "ms")][lib.name].append((t1 - t0) * 1e3)
        if p.exitcode != 0:
            raise RuntimeError(f"{lib.name} child exited with {p.exitcode}")

        p = lib.Process(target=child_noop)
        t0 = time.perf_counter()
        p.start()
        p.join()
        results[("start -> join, no-op target", "ms")][lib.name].append((time.perf_counter() - t0) * 1e3)
        if p.exitcode != 0:
            raise RuntimeError(f"{lib.name} child exited with {p.exitcode}")


# -- 2. pipe round trip --------------------------------------------------------------


def _ping(conn: Any, mode: str, n: int) -> list[float]:
    times = []
    clock = time.perf_counter
    conn.send((mode, n))
    if mode == "obj":
        send, recv, msg = conn.send, conn.recv, SMALL_OBJ
    else:
        send, recv, msg = conn.send_bytes, conn.recv_bytes, SMALL_BYTES
    for _ in range(n):
        t0 = clock()
        send(msg)
        recv()
        times.append(clock() - t0)
    if conn.recv() != "done":
        raise RuntimeError("echo child out of step")
    return times


def bench_pipe(libs: list[Lib], reps: int, n: int, results: dict) -> None:
    ends = {}
    for lib in libs:
        parent, child = lib.Pipe()
        p = lib.Process(target=child_echo, args=(child,))
        p.start()
        child.close()
        _ping(parent, "obj", 200)  # warm-up (and, for fiber, connect)
        _ping(parent, "bytes", 200)
        ends[lib.name] = (parent, p)
    for _, lib in rounds(libs, reps):
        conn = ends[lib.name][0]
        for mode, label in (("obj", "send/recv"), ("bytes", "send_bytes/recv_bytes")):
            rtt = statistics.median(_ping(conn, mode, n))
            results[(f"Pipe round trip, {label}", "us")][lib.name].append(rtt * 1e6)
    for conn, p in ends.values():
        conn.send(None)
        p.join()
        conn.close()


# -- 3. queue throughput ---------------------------------------------------------------


def bench_queue(libs: list[Lib], reps: int, n_small: int, n_big: int, results: dict) -> None:
    children = {}
    for lib in libs:
        ctrl, data, done = lib.Queue(), lib.Queue(), lib.Queue()
        p = lib.Process(target=child_queue, args=(ctrl, data, done))
        p.start()
        children[lib.name] = (ctrl, data, done, p)
        _queue_round(ctrl, data, done, "produce", 100, 0)  # warm-up (and, for fiber, connect)
        _queue_round(ctrl, data, done, "consume", 100, 0)
    cases = [
        ("Queue small msgs, child -> parent", "msg/s", "produce", n_small, 0),
        ("Queue small msgs, parent -> child", "msg/s", "consume", n_small, 0),
        ("Queue 1 MiB msgs, child -> parent", "MB/s", "produce", n_big, MIB),
        ("Queue 1 MiB msgs, parent -> child", "MB/s", "consume", n_big, MIB),
    ]
    for _, lib in rounds(libs, reps):
        ctrl, data, done, _p = children[lib.name]
        for label, unit, kind, n, size in cases:
            dt = _queue_round(ctrl, data, done, kind, n, size)
            rate = n / dt if size == 0 else n * size / dt / 1e6
            results[(label, unit)][lib.name].append(rate)
    for ctrl, _data, _done, p in children.values():
        ctrl.put(None)
        p.join()


def bench_queue_rtt(libs: list[Lib], reps: int, n: int, results: dict,
                    child_cpu: int | None = None) -> None:
    children = {}
    for lib in libs:
        into, back = lib.Queue(), lib.Queue()
        p = lib.Process(target=child_queue_echo, args=(into, back, child_cpu))
        p.start()
        children[lib.name] = (into, back, p)
        _queue_pings(into, back, 200)  # warm-up (and, for fiber, connect)
    for _, lib in rounds(libs, reps):
        into, back, _p = children[lib.name]
        rtt = statistics.median(_queue_pings(into, back, n))
        results[("Queue round trip, put -> get", "us")][lib.name].append(rtt * 1e6)
    for into, _back, p in children.values():
        into.put(None)
        p.join()


def _queue_pings(into: Any, back: Any, n: int) -> list[float]:
    times = []
    clock = time.perf_counter
    put, get = into.put, back.get
    for _ in range(n):
        t0 = clock()
        put(SMALL_OBJ)
        get()
        times.append(clock() - t0)
    return times


def _queue_round(ctrl: Any, data: Any, done: Any, kind: str, n: int, size: int) -> float:
    t0 = time.perf_counter()
    ctrl.put((kind, n, size))
    if kind == "produce":
        for _ in range(n):
            data.get()
    else:
        item = payload(size)
        for _ in range(n):
            data.put(item)
        done.get()
    return time.perf_counter() - t0


# -- where a Fiber Queue round trip goes (--breakdown) --------------------------------------
# White box: it wraps private methods of fiber_core's queue to read the clock there.
# time.perf_counter_ns is CLOCK_MONOTONIC on Linux, one clock for every process.

_STAMPS: dict[str, list[int]] = {}


def _stamp_calls(owner: Any, name: str, label: str, code: bytes | None = None) -> None:
    """Have every call of ``owner.name`` (with a frame of kind ``code``) record the clock."""
    inner = getattr(owner, name)
    stamps, clock = _STAMPS.setdefault(label, []), time.perf_counter_ns

    def stamped(self: Any, *args: Any) -> Any:
        if code is None or bytes(args[0][:1]) == code:
            stamps.append(clock())
        return inner(self, *args)

    setattr(owner, name, stamped)


def child_queue_echo_stamped(into: Any, back: Any, cpu: int | None = None) -> None:
    """:func:`child_queue_echo`, reading the clock as the item arrives, is got and is put."""
    from fiber_core.parallel.queues import _Borrower
    from fiber_core.wire.messages import QUEUE_ITEM

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})

    _stamp_calls(_Borrower, "_dispatch", "read", QUEUE_ITEM)
    got, put = _STAMPS.setdefault("got", []), _STAMPS.setdefault("put", [])
    clock = time.perf_counter_ns
    while (item := into.get()) is not None:
        got.append(clock())
        back.put(item)
        put.append(clock())
    back.put(_STAMPS)


def queue_rtt_breakdown(n: int, child_cpu: int | None = None) -> None:
    """Print the median of each step of Fiber's Queue round trip (the parent owns both queues)."""
    import fiber_core
    from fiber_core.parallel.queue_serve import Store

    _stamp_calls(Store, "lend", "lent")
    _stamp_calls(Store, "put_many", "stored")
    into, back = fiber_core.Queue(), fiber_core.Queue()
    p = fiber_core.Process(target=child_queue_echo_stamped, args=(into, back, child_cpu))
    p.start()
    _queue_pings(into, back, 200)  # warm-up: the child borrows from here on
    clock, sent, done = time.perf_counter_ns, [], []
    for _ in range(n):
        sent.append(clock())
        into.put(SMALL_OBJ)
        back.get()
        done.append(clock())
    into.put(None)
    child = back.get()
    p.join()
    # The last n of each: the warm-up came first, the None and the stamps last.
    at = {"sent": sent, "lent": _STAMPS["lent"][-n - 1:-1], "read": child["read"][-n - 1:-1],
          "got": child["got"][-n:], "put": child["put"][-n:],
          "stored": _STAMPS["stored"][-n - 1:-1], "done": done}
    steps = [
        ("sent", "lent", "parent's put -> the item is lent to the child's waiting get"),
        ("lent", "read", "-> the child has read it (one send, one wakeup)"),
        ("read", "got", "-> the child's get returns"),
        ("got", "put", "-> the child's put into the second queue returns"),
        ("put", "stored", "-> a hub thread of the owner has read it and stores it"),
        ("stored", "done", "-> the parent's get is handed the item, wakes and returns"),
        ("sent", "done", "round trip"),
    ]
    print(f"\nFiber Queue round trip, {n} pings, medians (us):\n")
    print("| step | us |")
    print("|---|---:|")
    for a, b, label in steps:
        print(f"| {label} | {statistics.median(y - x for x, y in zip(at[a], at[b])) / 1e3:.1f} |")


# -- report ------------------------------------------------------------------------------


HIGHER_IS_BETTER = {"msg/s", "MB/s"}


def fmt(value: float, unit: str) -> str:
    if unit == "msg/s":
        return f"{value:,.0f}"
    if unit == "us":
        return f"{value:.1f}"
    if unit == "ms":
        return f"{value:.1f}"
    return f"{value:.0f}"


def report(results: dict, command: str, elapsed: float, reps: dict) -> None:
    print()
    print(f"Command: `{command}`")
    print()
    print(f"Python {platform.python_version()} on {platform.system()} {platform.machine()}, "
          f"{os.cpu_count()} CPUs, affinity {sorted(os.sched_getaffinity(0))}; "
          f"fiber backend `{_backend_name()}`; multiprocessing start method `spawn`; "
          f"medians over {reps['start']} (start), {reps['pipe']} (Pipe), {reps['queue']} (Queue), "
          f"{reps['queue-rtt']} (Queue round trip) "
          f"interleaved rounds; {elapsed:.0f} s in all.")
    print()
    print("| metric | fiber | multiprocessing | ratio |")
    print("|---|---:|---:|---:|")
    medians = {}
    for (label, unit), by_lib in results.items():
        f = statistics.median(by_lib["fiber"])
        m = statistics.median(by_lib["multiprocessing"])
        medians[label] = (f, m)
        better = "higher" if unit in HIGHER_IS_BETTER else "lower"
        print(f"| {label} ({unit}, {better} is better) | {fmt(f, unit)} | {fmt(m, unit)} | {f / m:.2f}x |")
    print()
    print("ratio = fiber / multiprocessing.")
    checks = []
    for label, (f, m) in medians.items():
        if label.startswith("Pipe"):
            checks.append((f"{label}: within 2x of multiprocessing.Pipe", f <= 2 * m))
        elif label.startswith("Queue round trip"):
            checks.append((f"{label}: at most multiprocessing.Queue's", f <= m))
        elif label.startswith("Queue"):
            checks.append((f"{label}: at least multiprocessing.Queue", f >= m))
    print()
    print("Targets:")
    for what, ok in checks:
        print(f"- {'PASS' if ok else 'FAIL'} {what}")


def _backend_name() -> str:
    from fiber_core.runtime.run import runtime

    return runtime().backend.name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (under ~20 s)")
    parser.add_argument("--reps", type=int, default=None, help="rounds per library and section")
    parser.add_argument("--pin", type=int, default=None, metavar="CPU",
                        help="pin this process and every child to one CPU")
    parser.add_argument("--apart", default=None, metavar="CPU,CPU",
                        help="the Queue round trip with this process on the first CPU and the "
                             "child on the second (a wakeup then crosses CPUs)")
    parser.add_argument("--only", choices=("start", "pipe", "queue", "queue-rtt"), action="append",
                        help="run only these sections (repeatable)")
    parser.add_argument("--breakdown", action="store_true",
                        help="only Fiber's Queue round trip, step by step (white box)")
    args = parser.parse_args(argv)
    if args.pin is not None:  # first, so that every thread and child inherits it
        os.sched_setaffinity(0, {args.pin})
    child_cpu = None
    if args.apart is not None:
        try:
            mine, child_cpu = (int(c) for c in args.apart.split(","))
        except ValueError:
            parser.error(f"--apart takes two CPU numbers such as 0,1, not {args.apart!r}")
        os.sched_setaffinity(0, {mine})
    if args.breakdown:
        queue_rtt_breakdown(300 if args.quick else 3000, child_cpu)
        return 0
    if args.quick:
        reps = {"start": 3, "pipe": 3, "queue": 3, "queue-rtt": 3}
        n_rtt, n_small, n_big = 300, 3000, 30
    else:
        reps = {"start": 21, "pipe": 11, "queue": 9, "queue-rtt": 11}
        n_rtt, n_small, n_big = 2000, 20000, 150
    if args.reps is not None:
        reps = dict.fromkeys(reps, args.reps)
    sections = args.only or ["start", "pipe", "queue", "queue-rtt"]

    from collections import defaultdict

    results: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    libs = libraries()
    started = time.perf_counter()
    steps: list[tuple[str, Callable[[], None]]] = [
        ("start", lambda: bench_start(libs, reps["start"], results)),
        ("pipe", lambda: bench_pipe(libs, reps["pipe"], n_rtt, results)),
        ("queue", lambda: bench_queue(libs, reps["queue"], n_small, n_big, results)),
        ("queue-rtt", lambda: bench_queue_rtt(libs, reps["queue-rtt"], n_rtt, results, child_cpu)),
    ]
    for name, step in steps:
        if name in sections:
            t = time.perf_counter()
            step()
            print(f"{name}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    command = shlex.join(["python", *sys.argv])
    report(results, command, time.perf_counter() - started, reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
