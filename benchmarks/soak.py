"""Soak: the parent's memory and descriptors over repeated large maps, fiber.Pool against multiprocessing.Pool.

Each library runs in its own fresh interpreter (a *runner*) that holds one pool of
``--workers`` workers and maps a no-op over ``--tasks`` integers, ``--maps``
times (default chunksize). The two runners are driven in turn, one map each, so
both see the same machine at the same moments. After every map a runner reports
its resident set size (``VmRSS``) and its open descriptors; the first map is the
warm-up, and the growth is counted from it.

Usage::

    python benchmarks/soak.py                        # 25 maps of 1,000,000 tasks
    python benchmarks/soak.py --maps 5 --tasks 200000
    python benchmarks/soak.py --list                 # the input a list (built once), not a range

Only stdlib modules are imported at the top of this file, because spawned
``multiprocessing`` children import it again (as ``__mp_main__``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def noop(x: int) -> int:
    return x


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _runner(lib: str, workers: int, tasks: int, as_list: bool) -> None:
    """Hold one pool; on each line of stdin, map once and print ``seconds rss_kib fds``."""
    if lib == "fiber":
        import fiber_core as mp
    else:
        import multiprocessing as mp

        mp.set_start_method("spawn")  # as fiber: fresh interpreters, no fork of this one
    data = list(range(tasks)) if as_list else range(tasks)
    with mp.Pool(workers) as pool:
        for _ in sys.stdin:
            t = time.perf_counter()
            out = pool.map(noop, data)
            took = time.perf_counter() - t
            assert len(out) == tasks and out[-1] == tasks - 1
            del out
            print(f"{took:.3f} {_rss_kib()} {len(os.listdir('/proc/self/fd'))}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--maps", type=int, default=25)
    ap.add_argument("--tasks", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--list", action="store_true", help="map over a list built once (default: a range)")
    ap.add_argument("--runner", choices=("fiber", "multiprocessing"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.runner:
        _runner(args.runner, args.workers, args.tasks, args.list)
        return
    libs = ("fiber", "multiprocessing")
    runners = {lib: subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--runner", lib, "--workers", str(args.workers),
         "--tasks", str(args.tasks), *(["--list"] if args.list else [])], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for lib in libs}
    rows: dict[str, list[tuple[float, int, int]]] = {lib: [] for lib in libs}
    print(f"{args.maps} maps of {args.tasks:,} no-op tasks over a {'list' if args.list else 'range'}, "
          f"{args.workers} workers; after each map: "
          f"seconds, parent RSS (MiB), parent descriptors")
    print(f"{'map':>4} | {'fiber s':>8} {'RSS':>7} {'fds':>4} | {'mp s':>8} {'RSS':>7} {'fds':>4}")
    try:
        for i in range(args.maps):
            order = libs if i % 2 == 0 else libs[::-1]  # interleaved, the order flipping
            for lib in order:
                r = runners[lib]
                assert r.stdin is not None and r.stdout is not None
                r.stdin.write("map\n")
                r.stdin.flush()
                line = r.stdout.readline()
                if not line:
                    raise SystemExit(f"the {lib} runner ended early")
                took, rss, fds = line.split()
                rows[lib].append((float(took), int(rss), int(fds)))
            f, m = rows["fiber"][-1], rows["multiprocessing"][-1]
            print(f"{i + 1:>4} | {f[0]:>8.2f} {f[1] / 1024:>7.1f} {f[2]:>4} | "
                  f"{m[0]:>8.2f} {m[1] / 1024:>7.1f} {m[2]:>4}", flush=True)
    finally:
        for r in runners.values():
            if r.stdin is not None:
                r.stdin.close()
        for r in runners.values():
            r.wait(60)
    print()
    for lib in libs:
        first, last = rows[lib][0], rows[lib][-1]
        peak = max(r[1] for r in rows[lib])
        times = sorted(r[0] for r in rows[lib])
        print(f"{lib:>16}: RSS {first[1] / 1024:.1f} MiB after map 1, {last[1] / 1024:.1f} after map "
              f"{len(rows[lib])} (peak {peak / 1024:.1f}); descriptors {first[2]} -> {last[2]}; "
              f"median map {times[len(times) // 2]:.2f} s")


if __name__ == "__main__":
    main()
