"""Stragglers: an ES-style generation (one ``map``) when 5 % of the workers are 10x slow.

Each generation is ``pool.map`` of ``--tasks`` tasks that sleep ``--task-ms``
milliseconds times the worker's speed factor. The factor is a *worker setting*:
the pool's initializer gives each worker one (``--slow`` of them get 10, the
others 1), the task does not choose it. Three pools are measured, interleaved per
repetition: no straggler (the reference), stragglers without backup tasks, and
stragglers with ``Pool(backup=True)``. Every figure is the median generation time.

Usage::

    python benchmarks/stragglers.py                        # 20 workers, 1 slow
    python benchmarks/stragglers.py --workers 40 --slow 2 --reps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fiber_core  # noqa: E402

SPEED = 1.0  # this worker's slowness: set by the initializer, read by the task


def set_speed(speeds: fiber_core.Queue) -> None:
    global SPEED
    try:
        SPEED = speeds.get(timeout=1.0)
    except Exception:  # a replacement worker: nothing left to take
        SPEED = 1.0


def task(args: tuple[int, float]) -> int:
    x, seconds = args
    time.sleep(seconds * SPEED)  # the work itself
    return x


def generation_times(workers: int, slow: int, backup: bool, gens: int, tasks: int,
                     task_s: float) -> list[float]:
    speeds = fiber_core.Queue()
    for i in range(workers):
        speeds.put(10.0 if i < slow else 1.0)
    with fiber_core.Pool(workers, initializer=set_speed, initargs=(speeds,), backup=backup) as pool:
        pool.map(task, [(i, 0.0) for i in range(workers * 4)], chunksize=1)  # every worker up
        times = []
        for g in range(gens + 1):
            start = time.perf_counter()
            out = pool.map(task, [(i, task_s) for i in range(tasks)])
            elapsed = time.perf_counter() - start
            assert out == list(range(tasks))
            if g:  # the first generation measures the task time: not counted
                times.append(elapsed)
        return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=20)
    ap.add_argument("--slow", type=int, default=1, help="workers 10x slow (default 1: 5 %% of 20)")
    ap.add_argument("--tasks", type=int, default=400)
    ap.add_argument("--task-ms", type=float, default=10.0)
    ap.add_argument("--gens", type=int, default=5, help="generations per pool and repetition")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    task_s = args.task_ms / 1000
    cases = {"no straggler": (0, False), "stragglers": (args.slow, False),
             "stragglers + backup": (args.slow, True)}
    results: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(args.reps):
        order = list(cases) if rep % 2 == 0 else list(reversed(cases))
        for name in order:
            slow, backup = cases[name]
            results[name] += generation_times(args.workers, slow, backup, args.gens, args.tasks, task_s)
        print(f"repetition {rep + 1}/{args.reps} done", file=sys.stderr)
    ideal = args.tasks * task_s / args.workers
    print(f"{args.workers} workers ({args.slow} 10x slow), {args.tasks} tasks of {args.task_ms:g} ms "
          f"per generation (ideal {ideal:.3f} s); medians over {args.reps} x {args.gens} generations\n")
    print("| case | generation (s) | / no straggler | range (s) |")
    print("|---|---:|---:|---:|")
    base = statistics.median(results["no straggler"])
    for name, times in results.items():
        med = statistics.median(times)
        print(f"| {name} | {med:.3f} | {med / base:.2f} | {min(times):.3f}-{max(times):.3f} |")


if __name__ == "__main__":
    main()
