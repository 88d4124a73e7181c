"""Time from ``Pool(n)`` to all n workers ready, with group starts and one start at a time.

Workers of a Pool are started with one group start of the backend
(``Backend.start_jobs``), which the backend may serve at once: Kubernetes pods are
created ``create_concurrency`` at a time, SSH hosts filled in parallel. This runs
``Pool(n)`` on the configured backend (``FIBER_BACKEND``), alternating between the
group start and one start at a time (the contract's default ``create_jobs`` with
``create_concurrency`` 1, as before group starts), and prints the medians.

    FIBER_BACKEND=kubernetes python benchmarks/pool_start.py -n 64 --rounds 3
    FIBER_BACKEND=docker python benchmarks/pool_start.py -n 256 --rounds 3 --group-only

"Ready" is each worker connected and waiting for work; the pool is closed after.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fiber_core.contract.backend import Backend  # noqa: E402
from fiber_core.parallel.pool import Pool  # noqa: E402
from fiber_core.runtime.run import runtime  # noqa: E402


def time_ready(n: int, serial: bool, timeout: float) -> float:
    backend = runtime().backend
    saved = type(backend).__dict__.get("create_concurrency")
    if serial:  # the contract's default, one create_job after another (no array job either)
        type(backend).create_concurrency = 1  # type: ignore[misc, assignment]
        backend.create_jobs = functools.partial(Backend.create_jobs, backend)  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        pool = Pool(n)
        try:
            while True:
                with pool._lock:
                    ready = sum(1 for w in pool._workers.values() if w.ready and not w.lost)
                if ready >= n:
                    return time.perf_counter() - start
                if time.perf_counter() - start > timeout:
                    raise TimeoutError(f"only {ready} of {n} workers ready after {timeout:g} s")
                time.sleep(0.01)
        finally:
            pool.terminate()
            pool.join()
    finally:
        if serial:
            del backend.create_jobs
            if saved is None:
                del type(backend).create_concurrency
            else:
                type(backend).create_concurrency = saved  # type: ignore[misc]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=32, help="workers (default 32)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--group-only", action="store_true", help="the group start only (big pools)")
    args = ap.parse_args()
    backend = runtime().backend
    modes = ("group",) if args.group_only else ("group", "serial")
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            times[mode].append(time_ready(args.n, mode == "serial", args.timeout))
    group = statistics.median(times["group"])
    print(f"backend {backend.name}, Pool({args.n}), {args.rounds} rounds, medians:")
    print(f"  group start (create_concurrency={backend.create_concurrency}): {group:.2f} s "
          f"({min(times['group']):.2f}-{max(times['group']):.2f})")
    if "serial" in times:
        serial = statistics.median(times["serial"])
        print(f"  one at a time:                                   {serial:.2f} s  ({serial / group:.2f}x)")


if __name__ == "__main__":
    main()
