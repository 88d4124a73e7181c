"""Fiber's synchronization objects and shared ctypes against multiprocessing's, in one run.

    python benchmarks/sync.py [--reps 7] [--docker IMAGE] [--pin CPU]

Each measurement runs for ``multiprocessing`` (spawn context) and for Fiber (local
backend), in interleaved rounds; the table shows the median over ``--reps`` rounds:

* Lock acquire/release, uncontended: one pair, in the creator;
* Lock contended by 4 jobs: each job does N ``with lock: counter.value += 1`` on a
  RawValue, all starting at a Barrier; time per increment, for the whole group;
* Event set-to-wakeup: two processes ping-pong on two Events (set, wait, clear);
  half a round trip;
* Value increments under its lock: ``with v.get_lock(): v.value += 1``, in the creator;
* a 1 MiB Array slice read: ``arr[:]`` of an ``Array('d', 131072)``, in the creator.

Then the served path, where each operation is a round trip to the creator: a
local job forced onto it (``FIBER_SYNC_SERVED=1``) and, with ``--docker IMAGE``, a
job in a container on the Docker backend (``DOCKER_HOST`` names the daemon; run
from the source tree, which the containers mount as their working directory).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import fiber_core

N_CONTEND = 2000  # increments per job
N_PINGS = 300
WORKERS = 4
pc = time.perf_counter


# -- what the jobs run ----------------------------------------------------------------------


def contend(objs: dict, n: int) -> float:
    lock, counter = objs["lock"], objs["counter"]
    objs["barrier"].wait()
    for _ in range(n):
        with lock:
            counter.value += 1
    return pc()


def pong(objs: dict, n: int) -> None:
    ping, pong_ = objs["ping"], objs["pong"]
    for _ in range(n):
        ping.wait()
        ping.clear()
        pong_.set()


def served_ops(objs: dict, n: int) -> dict[str, float]:
    """Microseconds per operation, timed in the job."""
    lock, value, arr, event = objs["lock"], objs["value"], objs["array"], objs["ping"]
    out = {}

    def per_op(name: str, op: Callable[[], Any], reps: int = n) -> None:
        op()
        t = pc()
        for _ in range(reps):
            op()
        out[name] = (pc() - t) / reps * 1e6

    def acquire_release() -> None:
        lock.acquire()
        lock.release()

    def increment() -> None:
        with value.get_lock():
            value.value += 1

    per_op("Lock acquire + release (2 round trips)", acquire_release)
    per_op("Value increment under its lock (4 round trips)", increment)
    per_op("Event.is_set()", event.is_set)
    per_op("Array element read arr[7]", lambda: arr[7])
    per_op("1 MiB Array slice read arr[:]", lambda: arr[:], max(3, n // 100))
    return out


def worker(cmds: Any, results: Any, objs: dict) -> None:
    """Run commands until None: (name, argument) -> the function's result."""
    functions = {"contend": contend, "pong": pong, "served_ops": served_ops}
    while (cmd := cmds.get()) is not None:
        name, arg = cmd
        results.put(functions[name](objs, arg))


# -- one implementation ----------------------------------------------------------------------


class Impl:
    """Objects and started worker jobs of one implementation."""

    def __init__(self, name: str, mp: Any, workers: int, **process_kwargs: Any) -> None:
        self.name = name
        self.objs = {"lock": mp.Lock(), "counter": mp.RawValue("i", 0), "ping": mp.Event(),
                     "pong": mp.Event(), "value": mp.Value("i", 0),
                     "array": mp.Array("d", 1 << 17), "barrier": mp.Barrier(workers + 1)}
        self.results = mp.Queue()
        self.cmds = [mp.Queue() for _ in range(workers)]
        self.procs = [mp.Process(target=worker, args=(c, self.results, self.objs), **process_kwargs)
                      for c in self.cmds]
        for p in self.procs:
            p.start()

    def stop(self) -> None:
        for c in self.cmds:
            c.put(None)
        for p in self.procs:
            p.join(60)

    # each returns microseconds

    def lock_uncontended(self) -> float:
        lock = self.objs["lock"]
        acquire, release = lock.acquire, lock.release
        n = 200_000
        t = pc()
        for _ in range(n):
            acquire()
            release()
        return (pc() - t) / n * 1e6

    def contended(self) -> float:
        for c in self.cmds:
            c.put(("contend", N_CONTEND))
        self.objs["barrier"].wait()
        t = pc()
        end = max(self.results.get() for _ in self.cmds)
        return (end - t) / (N_CONTEND * len(self.cmds)) * 1e6

    def event_wakeup(self) -> float:
        ping, pong_ = self.objs["ping"], self.objs["pong"]
        self.cmds[0].put(("pong", N_PINGS))
        times = []
        for _ in range(N_PINGS):
            t = pc()
            ping.set()
            pong_.wait()
            pong_.clear()
            times.append(pc() - t)
        self.results.get()
        return statistics.median(times) / 2 * 1e6

    def value_increment(self) -> float:
        value = self.objs["value"]
        n = 100_000
        t = pc()
        for _ in range(n):
            with value.get_lock():
                value.value += 1
        return (pc() - t) / n * 1e6

    def slice_read(self) -> float:
        arr = self.objs["array"]
        n = 20
        t = pc()
        for _ in range(n):
            arr[:]
        return (pc() - t) / n * 1e6


MEASURES = [
    ("Lock acquire/release, uncontended", "lock_uncontended"),
    (f"Lock contended by {WORKERS} jobs (per increment)", "contended"),
    ("Event set-to-wakeup (half a ping-pong)", "event_wakeup"),
    ("Value increment under its lock", "value_increment"),
    ("1 MiB Array slice read arr[:]", "slice_read"),
]


def served(label: str, reps: int, **process_kwargs: Any) -> dict[str, float]:
    """Per-operation microseconds of one job on the served path (median over reps)."""
    impl = Impl(label, fiber_core, 1, **process_kwargs)
    try:
        runs = []
        for _ in range(reps):
            impl.cmds[0].put(("served_ops", 200))
            runs.append(impl.results.get())
        pings = [impl.event_wakeup() for _ in range(reps)]
    finally:
        impl.stop()
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["Event set-to-wakeup (half a ping-pong)"] = statistics.median(pings)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="interleaved rounds")
    parser.add_argument("--docker", metavar="IMAGE", help="also time a job on the Docker backend")
    parser.add_argument("--pin", type=int, metavar="CPU",
                        help="pin this process and its local jobs to one CPU")
    args = parser.parse_args(argv)
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})  # children inherit it

    impls = [Impl("multiprocessing", multiprocessing.get_context("spawn"), WORKERS),
             Impl("fiber", fiber_core, WORKERS)]
    results: dict[tuple[str, str], list[float]] = {}
    try:
        for impl in impls:  # warm-up
            for _, method in MEASURES:
                getattr(impl, method)()
        for _ in range(args.reps):
            for _, method in MEASURES:
                for impl in impls:
                    results.setdefault((impl.name, method), []).append(getattr(impl, method)())
    finally:
        for impl in impls:
            impl.stop()

    pinned = "" if args.pin is None else f", all pinned to CPU {args.pin}"
    print(f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs{pinned}; microseconds, median "
          f"over {args.reps} interleaved rounds (load average {os.getloadavg()[0]:.1f}).\n")
    print("| operation | multiprocessing (us) | fiber (us) | fiber / multiprocessing |")
    print("|---|---:|---:|---:|")
    for label, method in MEASURES:
        std = statistics.median(results[("multiprocessing", method)])
        fib = statistics.median(results[("fiber", method)])
        print(f"| {label} | {std:.3f} | {fib:.3f} | {fib / std:.2f}x |")

    columns = {}
    os.environ["FIBER_SYNC_SERVED"] = "1"  # the next jobs never attach
    try:
        columns["local job, served"] = served("served", args.reps)
        if args.docker:
            columns["Docker job"] = served("docker", args.reps, backend="docker", image=args.docker)
    finally:
        del os.environ["FIBER_SYNC_SERVED"]
    names = list(columns)
    print(f"\nThe served path, timed in the job (microseconds per operation, median over {args.reps}):\n")
    print("| operation | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for op in columns[names[0]]:
        print(f"| {op} | " + " | ".join(f"{columns[n][op]:.0f}" for n in names) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
