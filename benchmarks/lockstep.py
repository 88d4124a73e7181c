"""The Fiber paper's lock-step path: many rounds of ``map`` over as many 1 ms tasks as workers.

Each round waits for the slowest of its tasks, as a synchronous RL or ES generation
does: ``--rounds`` rounds of ``pool.map(sleep_1ms, range(n))`` on ``Pool(n)``, timed
after the pool is warm (1.0 s is ideal for 1,000 rounds). Fiber and ``multiprocessing``
(fork and spawn) alternate within each repetition; medians.

    python benchmarks/lockstep.py --rounds 1000 -n 5 --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def sleep_1ms(x: int) -> int:
    time.sleep(0.001)
    return x


def measure(lib: str, n: int, rounds: int) -> float:
    if lib == "fiber":
        import fiber_core as ctx
    else:
        import multiprocessing

        ctx = multiprocessing.get_context(lib)  # type: ignore[assignment]
    with ctx.Pool(n) as pool:
        for _ in range(20):  # warm: every worker started and has the function
            pool.map(sleep_1ms, range(n))
        start = time.perf_counter()
        for _ in range(rounds):
            pool.map(sleep_1ms, range(n))
        return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    libs = ["fiber", "fork", "spawn"]
    times: dict[str, list[float]] = {lib: [] for lib in libs}
    for rep in range(args.reps):
        for lib in libs if rep % 2 == 0 else reversed(libs):
            times[lib].append(measure(lib, args.n, args.rounds))
    print(f"{args.rounds} rounds of map over {args.n} tasks of 1 ms on Pool({args.n}) "
          f"(ideal {args.rounds * 0.001:.2f} s); medians of {args.reps}")
    for lib in libs:
        name = "fiber" if lib == "fiber" else f"multiprocessing ({lib})"
        print(f"{name:<26}{statistics.median(times[lib]):8.3f} s")


if __name__ == "__main__":
    main()
