"""The per-message paths of Queue and Pool, this tree against another fiber_core tree.

What is timed (local backend, one long-lived child or a pool of 2):

* Queue, child -> parent: the child puts small items, the owner (parent) gets
  them: the owner's parsing of puts that arrive in runs.
* Queue, parent -> child: the parent puts, the child gets: lending, batches,
  acknowledgements.
* Bounded queue, child -> parent: every put is a request and a reply.
* ``qsize()`` from the child: a request and a reply, no item.
* ``Pool.apply`` of a no-op, one after another: a task frame and a result frame.
* ``Pool.map`` and ``imap_unordered`` of a no-op, ``chunksize=1``: tasks per second.

For the busiest paths the parent's CPU time per item is given too: on a shared
machine it varies less than the rates do.

``--against DIR`` runs this file in fresh interpreters, with ``PYTHONPATH=DIR``
and with this tree's root, alternating (the order flips every round), and prints
the median of each figure for both and their ratio. Without it, one run of this
tree prints its figures::

    python benchmarks/wire.py --against /path/to/other/checkout --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

SMALL = ("msg", 42, 3.14)
HIGHER_IS_BETTER = {"items/s", "tasks/s"}


def noop(x: Any = None) -> Any:
    return x


def child(ctrl: Any, data: Any, bounded: Any, done: Any) -> None:
    while (cmd := ctrl.get()) is not None:
        kind, n = cmd
        if kind == "produce":
            for _ in range(n):
                data.put(SMALL)
        elif kind == "consume":
            for _ in range(n):
                data.get()
            done.put("ok")
        elif kind == "bounded":
            for _ in range(n):
                bounded.put(SMALL)
        elif kind == "qsize":
            t = time.perf_counter()
            for _ in range(n):
                bounded.qsize()
            done.put(time.perf_counter() - t)


def run_once(scale: float) -> dict[str, tuple[float, str]]:
    import fiber_core

    out: dict[str, tuple[float, str]] = {}
    n_items, n_bounded, n_calls = int(20000 * scale), int(3000 * scale), int(2000 * scale)
    n_apply, n_map = int(1000 * scale), int(5000 * scale)
    ctrl, data, done = fiber_core.Queue(), fiber_core.Queue(), fiber_core.Queue()
    bounded = fiber_core.Queue(maxsize=100)
    p = fiber_core.Process(target=child, args=(ctrl, data, bounded, done))
    p.start()
    for kind, n in (("produce", 200), ("consume", 200), ("bounded", 200), ("qsize", 50)):
        ctrl.put((kind, n))  # warm-up: every connection made
        if kind == "produce":
            for _ in range(n):
                data.get()
        elif kind == "consume":
            for _ in range(n):
                data.put(SMALL)
            done.get()
        elif kind == "bounded":
            for _ in range(n):
                bounded.get()
        else:
            done.get()

    t, c = time.perf_counter(), time.process_time()
    ctrl.put(("produce", n_items))
    for _ in range(n_items):
        data.get()
    out["Queue, child -> parent"] = (n_items / (time.perf_counter() - t), "items/s")
    out["Queue, child -> parent: CPU of the parent"] = (
        (time.process_time() - c) / n_items * 1e6, "us/item")

    t, c = time.perf_counter(), time.process_time()
    ctrl.put(("consume", n_items))
    for _ in range(n_items):
        data.put(SMALL)
    done.get()
    out["Queue, parent -> child"] = (n_items / (time.perf_counter() - t), "items/s")
    out["Queue, parent -> child: CPU of the parent"] = (
        (time.process_time() - c) / n_items * 1e6, "us/item")

    t = time.perf_counter()
    ctrl.put(("bounded", n_bounded))
    for _ in range(n_bounded):
        bounded.get()
    rate = n_bounded / (time.perf_counter() - t)
    out["Bounded queue (100), child -> parent"] = (rate, "items/s")

    ctrl.put(("qsize", n_calls))
    out["qsize() from the child"] = (done.get() / n_calls * 1e6, "us")
    ctrl.put(None)
    p.join()

    with fiber_core.Pool(2) as pool:
        pool.map(noop, range(100), chunksize=1)  # warm-up: both workers up, noop shipped
        t = time.perf_counter()
        for i in range(n_apply):
            pool.apply(noop, (i,))
        out["Pool.apply, one after another"] = ((time.perf_counter() - t) / n_apply * 1e6, "us")
        t, c = time.perf_counter(), time.process_time()
        pool.map(noop, range(n_map), chunksize=1)
        out["Pool.map, chunksize=1"] = (n_map / (time.perf_counter() - t), "tasks/s")
        out["Pool.map, chunksize=1: CPU of the parent"] = (
            (time.process_time() - c) / n_map * 1e6, "us/task")
        t = time.perf_counter()
        for _ in pool.imap_unordered(noop, range(n_map)):
            pass
        out["Pool.imap_unordered, chunksize=1"] = (n_map / (time.perf_counter() - t), "tasks/s")
    return out


def fmt(value: float, unit: str) -> str:
    return f"{value:,.0f}" if unit in HIGHER_IS_BETTER else f"{value:.1f}"


def compare(other: str, rounds: int, scale: float) -> None:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"other": os.path.abspath(other), "this": here}
    results: dict[str, dict[str, list[float]]] = {}
    units: dict[str, str] = {}
    for r in range(rounds):
        for name in (("other", "this") if r % 2 == 0 else ("this", "other")):
            env = {**os.environ, "PYTHONPATH": trees[name]}
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--scale", str(scale)],
                                  env=env, cwd=trees[name],  # jobs run `python -m` there
                                  check=True, capture_output=True, text=True, timeout=600)
            for label, (value, unit) in json.loads(proc.stdout.splitlines()[-1]).items():
                results.setdefault(label, {"other": [], "this": []})[name].append(value)
                units[label] = unit
        print(f"round {r + 1}/{rounds} (load average {os.getloadavg()[0]:.2f})", file=sys.stderr)
    print(f"\nthis = {trees['this']}, other = {trees['other']}; medians over {rounds} "
          f"interleaved rounds (min-max in brackets)\n")
    print("| metric | other | this | this / other |")
    print("|---|---:|---:|---:|")
    for label, by in results.items():
        unit = units[label]
        a, b = statistics.median(by["other"]), statistics.median(by["this"])
        better = "higher" if unit in HIGHER_IS_BETTER else "lower"
        span = (f" [{fmt(min(by['other']), unit)}-{fmt(max(by['other']), unit)}]",
                f" [{fmt(min(by['this']), unit)}-{fmt(max(by['this']), unit)}]")
        print(f"| {label} ({unit}, {better} is better) | {fmt(a, unit)}{span[0]} "
              f"| {fmt(b, unit)}{span[1]} | {b / a:.3f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", metavar="DIR", help="another tree to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every count")
    args = parser.parse_args(argv)
    if args.against:
        compare(args.against, args.rounds, args.scale)
    else:
        print(json.dumps(run_once(args.scale)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
