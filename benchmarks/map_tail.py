"""The end of a map of uneven tasks: its time over the ideal, against multiprocessing.

A map's last tasks decide when it ends. With tasks of uneven length, a task that waits behind
another worker's batch while some worker is idle makes the map longer than it needs to be.
Each map here is ``--tasks`` sleeps whose lengths are drawn from an exponential distribution of
mean ``--mean-ms`` (the same seeded draws for every library), on ``-n`` workers, with each
library's default chunksize. Its ideal is the longer of the work divided among the workers and
the longest task; the figure is the map's time over that ideal, the median of ``--maps`` maps
on one pool whose every worker has run a task. Each measure runs in a program of its own; the libraries alternate every
round (the order flips); medians of the rounds.

``--against DIR`` measures the ``fiber_core`` of the checkout ``DIR`` too (``fiber (ref)``).

    python benchmarks/map_tail.py -n 8 --tasks 200 --mean-ms 30
    python benchmarks/map_tail.py -n 8 --tasks 400 --mean-ms 5 --against ../base
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

def worker_pid(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def warm(pool: Any, n: int) -> None:
    """Until every one of the pool's ``n`` workers has run a task: a Fiber pool's workers join
    it as they start, and a map timed while some are still starting measures their start."""
    seen: set[int] = set()
    deadline = time.monotonic() + 600
    while len(seen) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(seen)} of {n} workers ran a task in 600 s")
        seen.update(pool.map(worker_pid, [0.01] * (2 * n)))


def draws(maps: int, tasks: int, mean: float) -> list[list[float]]:
    """Each map's task lengths (seconds): the same for every library and checkout."""
    rng = random.Random(32)
    return [[rng.expovariate(1 / mean) for _ in range(tasks)] for _ in range(maps)]


def in_program(lib: str, n: int, lengths: list[list[float]]) -> list[float]:
    """Each map's time over its ideal, in this program, on a pool of ``n`` whose every worker
    has run a task."""
    # this folder's (sys.path[0]), imported here: the workers, which import this file, need only
    # sleep_task (they get this program's sys.path)
    from task_cpu import new_pool, sleep_task

    pool = new_pool(lib, n)
    ratios = []
    try:
        warm(pool, n)
        pool.map(sleep_task, [0.001] * (4 * n))  # every worker has run the function
        for each in lengths:
            ideal = max(sum(each) / n, max(each))
            t0 = time.perf_counter()
            pool.map(sleep_task, each)
            ratios.append((time.perf_counter() - t0) / ideal)
    finally:
        pool.terminate()
        pool.join()
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=8, help="workers")
    ap.add_argument("--tasks", type=int, default=200, help="tasks per map")
    ap.add_argument("--mean-ms", type=float, default=30.0, help="the tasks' mean length")
    ap.add_argument("--maps", type=int, default=12, help="maps per measure")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--against", help="a checkout whose fiber_core is measured too")
    ap.add_argument("--libs", default="forkserver", help="multiprocessing's start methods")
    ap.add_argument("--in-program", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.n < 1 or args.tasks < 1 or args.maps < 1 or args.rounds < 1 or args.mean_ms <= 0:
        ap.error("-n, --tasks, --maps and --rounds must be at least 1, and --mean-ms over 0")
    from task_cpu import HERE, run_in_program  # this folder's (sys.path[0]), as in_program's

    lengths = draws(args.maps, args.tasks, args.mean_ms / 1e3)
    if args.in_program:
        print(json.dumps(in_program(args.in_program, args.n, lengths)))
        return
    modes = [("fiber", HERE)] + ([("fiber (ref)", os.path.abspath(args.against))] if args.against else [])
    modes += [(lib, HERE) for lib in args.libs.split(",") if lib]
    results: dict[str, list[float]] = {name: [] for name, _ in modes}
    for r in range(args.rounds):
        for name, repo in modes if r % 2 == 0 else modes[::-1]:
            lib = "fiber" if name.startswith("fiber") else name
            argv = ["--in-program", lib, "-n", str(args.n), "--tasks", str(args.tasks),
                    "--mean-ms", str(args.mean_ms), "--maps", str(args.maps)]
            results[name].append(statistics.median(json.loads(run_in_program(__file__, argv, repo, name))))
    print(f"Pool({args.n}), maps of {args.tasks} sleeps of exponential lengths (mean {args.mean_ms:g} ms), "
          f"default chunksize; a map's time over its ideal, the median of {args.maps} maps, by round "
          f"(load average {os.getloadavg()[0]:.1f}):")
    for name, runs in results.items():
        print(f"  {name:12s} {statistics.median(runs):.3f}  (rounds: {', '.join(f'{x:.3f}' for x in runs)})")


if __name__ == "__main__":
    main()
