"""CPU per task of a map of 10 ms sleeps, in the parent and in the workers, against multiprocessing.

On a machine with few CPUs and many workers (512 on 2 CPUs), a map of short tasks is paced
by the CPU every task costs, not by the tasks' own time: this counts it. The parent's CPU is
its own clock (every thread: the master, the hub, the caller); the workers' (every thread of
each) and that of the program's other child processes (Fiber's template) are read from
``/proc/PID/task/TID/schedstat``, in nanoseconds, before and after the map. Each measure runs
in a program of its own; the libraries alternate every round (the order flips); medians. The
other programs' share of the machine during each map is shown too (``/proc/stat``'s busy time
less this program's): on a shared machine, read only rows taken while it was small.

``--against DIR`` measures the ``fiber_core`` of the checkout ``DIR`` too (``fiber (ref)``).

    python benchmarks/task_cpu.py -n 16 --tasks 3200 --rounds 3
    python benchmarks/task_cpu.py -n 16 --tasks 3200 --chunksize 10 --against ../base
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sleep_task(x: float) -> float:
    time.sleep(x)
    return x


def pid_cpu(pid: int) -> float:
    """Seconds of CPU of every thread of ``pid`` (0 once it is gone)."""
    total = 0
    for stat in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            with open(stat) as f:
                total += int(f.read().split()[0])
        except OSError:
            pass
    return total / 1e9


def children(pid: int) -> list[int]:
    """Every process under ``pid``."""
    kids: dict[int, list[int]] = {}
    for d in glob.glob("/proc/[0-9]*"):
        try:
            with open(d + "/stat") as f:
                kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(d[6:]))
        except (OSError, ValueError):
            pass
    out, todo = [], list(kids.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def busy_seconds() -> float:
    """The machine's busy CPU seconds so far (all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def new_pool(lib: str, n: int) -> Any:
    """A Pool of ``n`` workers: Fiber's (``lib`` "fiber"), or multiprocessing's with the start
    method ``lib``."""
    if lib == "fiber":
        import fiber_core

        return fiber_core.Pool(n)
    import multiprocessing

    return multiprocessing.get_context(lib).Pool(n)


def run_in_program(script: str, argv: list[str], repo: str, name: str) -> str:
    """The last line printed by ``script`` run with ``argv`` in a program of its own, with the
    ``fiber_core`` of the checkout ``repo``; a failure raises with its error output."""
    out = subprocess.run([sys.executable, os.path.abspath(script), *argv], capture_output=True, text=True,
                         timeout=900, env={**os.environ, "PYTHONPATH": repo},
                         cwd=repo)  # jobs run `python -m`, which imports from the working directory first
    if out.returncode != 0:
        raise RuntimeError(f"{name}: {out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()[-1]


def in_program(lib: str, n: int, tasks: int, chunksize: int | None) -> dict[str, float]:
    """One measure, in this program: a pool of ``n``, warmed, then the timed map."""
    pool = new_pool(lib, n)
    try:
        pool.map(sleep_task, [0.0] * (4 * n))
        pool.map(sleep_task, [0.01] * (2 * n))  # every worker has run the function
        pids = ([w.process.pid for w in pool._workers.values()] if lib == "fiber"  # type: ignore[attr-defined]
                else [p.pid for p in pool._pool])  # type: ignore[attr-defined]
        others = [p for p in children(os.getpid()) if p not in set(pids)]
        o0, w0, b0 = sum(map(pid_cpu, others)), sum(map(pid_cpu, pids)), busy_seconds()
        p0, t0 = time.process_time(), time.perf_counter()
        pool.map(sleep_task, [0.01] * tasks, chunksize=chunksize)
        t1, p1 = time.perf_counter(), time.process_time()
        b1, w1, o1 = busy_seconds(), sum(map(pid_cpu, pids)), sum(map(pid_cpu, others))
    finally:
        pool.terminate()
        pool.join()
    own = (w1 - w0) + (p1 - p0) + (o1 - o0)
    return {"workers_us": (w1 - w0) / tasks * 1e6, "parent_us": (p1 - p0) / tasks * 1e6,
            "children_us": (o1 - o0) / tasks * 1e6, "rate": tasks / (t1 - t0),
            "others": max(0.0, (b1 - b0) - own) / (t1 - t0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=16, help="workers")
    ap.add_argument("--tasks", type=int, default=3200)
    ap.add_argument("--chunksize", type=int, default=None, help="default: each library's own choice")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--against", help="a checkout whose fiber_core is measured too")
    ap.add_argument("--libs", default="fork,forkserver,spawn", help="multiprocessing's start methods")
    ap.add_argument("--in-program", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.in_program:
        print(json.dumps(in_program(args.in_program, args.n, args.tasks, args.chunksize)))
        return
    modes = [("fiber", HERE)] + ([("fiber (ref)", os.path.abspath(args.against))] if args.against else [])
    modes += [(lib, HERE) for lib in args.libs.split(",") if lib]
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in modes}
    extra = [] if args.chunksize is None else ["--chunksize", str(args.chunksize)]
    for r in range(args.rounds):
        for name, repo in modes if r % 2 == 0 else modes[::-1]:
            lib = "fiber" if name.startswith("fiber") else name
            argv = ["--in-program", lib, "-n", str(args.n), "--tasks", str(args.tasks), *extra]
            results[name].append(json.loads(run_in_program(__file__, argv, repo, name)))
    print(f"Pool({args.n}), map of {args.tasks} tasks of 10 ms, chunksize {args.chunksize or 'default'}, "
          f"medians of {args.rounds} (load average {os.getloadavg()[0]:.1f}):")
    for name, runs in results.items():
        others = ", ".join(f"{x.get('others', 0.0):.2f}" for x in runs)
        print(f"  {name:12s} workers {statistics.median(x['workers_us'] for x in runs):7.1f} us/task, "
              f"parent {statistics.median(x['parent_us'] for x in runs):6.1f} us/task, "
              f"other children {statistics.median(x.get('children_us', 0.0) for x in runs):5.1f} us/task, "
              f"{statistics.median(x['rate'] for x in runs):8.0f} tasks/s; other programs took "
              f"{others} CPUs")


if __name__ == "__main__":
    main()
