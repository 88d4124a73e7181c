"""Framework overhead, as in the Fiber paper (Figure 9): fiber.Pool against multiprocessing.Pool.

The experiment of the paper: 5 workers; tasks that sleep 1 s, 100 ms, 10 ms or
1 ms; batch sizes 5, 50, 500 and 5000, so that the ideal time of each batch is
1 s; ``pool.map`` (default chunksize) is timed. Both libraries are measured in
the same run, in alternating repetitions (the order flips every repetition), and
every figure is the median over the repetitions. Also measured:

* the *sleep floor*: the time one process takes for the whole batch of sleeps,
  divided by the 5 workers (so ``time.sleep``'s own overshoot on this machine,
  which no framework can beat). It is sampled every repetition (a budget of
  about 0.25 s of sleeps per duration, at least one sleep) and scaled to the batch;
* ``multiprocessing.Pool.map`` with ``chunksize=1`` as well, for reference: the
  stdlib's default chunksize (``len / (4 * workers)``, rounded up) is what the
  targets compare against, but it groups 3 of the fifty 100 ms tasks per chunk,
  which costs it time there;
* tiny-task throughput: 20,000 no-op tasks through ``map``, with the default
  chunksize (5 maps per repetition: one takes a few milliseconds) and with
  ``chunksize=1`` (one map);
* pool start to first result: ``Pool(5)`` then ``apply`` of a no-op, timed together,
  in this process (where the library is imported and a pool ran before: *warm*),
  and in a fresh interpreter (*cold*: the clock starts before the library's import);
* a scale run: a pool of many workers (256 by default) on this machine, with the
  start (``Pool()`` returns, first result, every worker has run a task) measured
  apart from the throughput (no-op tasks, and 10 ms sleeps whose ideal rate is
  ``workers / 10 ms``) that one master sustains. multiprocessing is run too,
  unless ``--scale-fiber-only``; a failure there is reported, not fatal. With
  ``--scale-rounds N`` the libraries alternate (the order flips every round) and each
  round's maps of 10 ms tasks are shown side by side, with the load average at each
  start (which counts the pool's own workers too) and the CPUs other programs took
  during the maps (``/proc/stat`` less this program's and its workers' own CPU); the
  target is fiber ahead in every round. Only the maps are timed there, on a
  started and warmed pool; the start is reported apart. A round's figure is the
  median of ``--scale-maps`` maps on the same pool (5 by default: one map takes about
  half a second at 512 workers, so that one burst of other programs' work can decide
  it), and each map's figure is shown beside it.

Each repetition, each library gets one pool: it is created and timed to its
first result, warmed up (a map until every worker has returned a task, and one
small map of each function used), then the timed maps run on it, then it is
closed and joined before the other library's turn.

Usage::

    python benchmarks/overhead.py                 # about 2-3 minutes (5 repetitions)
    python benchmarks/overhead.py --quick         # smoke run, under a minute
    python benchmarks/overhead.py --reps 9 --skip-scale
    python benchmarks/overhead.py --scale-only --scale-workers 512 --scale-rounds 3

Ratios are fiber / multiprocessing in *time* (for throughputs: the inverse ratio
of the rates), so ``<= 1.00`` means fiber is at least as fast. The fiber side uses
the configured backend (``FIBER_BACKEND``, default ``local``). Only stdlib modules
are imported at the top of this file, because spawned ``multiprocessing``
children import it again (as ``__mp_main__``).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

WORKERS = 5
CASES = [(1.0, 5), (0.1, 50), (0.01, 500), (0.001, 5000)]  # (task seconds, batch size)
TINY_TASKS = 20_000
TINY_SAMPLES = {None: 5, 1: 1}  # maps per repetition: the default-chunksize one takes milliseconds
FLOOR_BUDGET = 0.25  # seconds of sleeps sampled per duration and repetition
READY_TIMEOUT = 300.0
MAP_TIMEOUT = 600.0

FIBER, MP = "fiber", "multiprocessing"
TEN_MS = "ten_ms"  # a scale run's key for its maps of 10 ms tasks (default chunksize): the median, the rounds' measure
TEN_MS_EACH = "ten_ms_each"  # ... and each of those maps' tasks/s, in order
OTHERS = "CPUs busy with other programs during the 10 ms map"

COLD_START = """
import sys, time
t0 = time.perf_counter()
if sys.argv[1] == "fiber":
    import fiber_core
    pool = fiber_core.Pool(int(sys.argv[2]))
else:
    import multiprocessing
    pool = multiprocessing.get_context("spawn").Pool(int(sys.argv[2]))
pool.apply(abs, (-1,))
print(time.perf_counter() - t0, flush=True)
pool.terminate()
"""
"""A fresh interpreter: import the library, start a pool, get one result (a builtin: ``-c``
has no main module to import)."""


# -- what the workers run (module level: spawn needs to import them) -------------------


def sleep_task(seconds: float) -> None:
    time.sleep(seconds)


def noop(x: Any = None) -> Any:
    return x


def pid_after(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


# -- the two libraries ----------------------------------------------------------------


def make_pool(lib: str, n: int) -> Any:
    if lib == FIBER:
        import fiber_core

        return fiber_core.Pool(n)
    return multiprocessing.get_context("spawn").Pool(n)


def order(r: int) -> list[str]:
    return [FIBER, MP] if r % 2 == 0 else [MP, FIBER]


def timed_map(pool: Any, func: Callable, items: list, chunksize: int | None = None) -> float:
    t0 = time.perf_counter()
    out = pool.map_async(func, items, chunksize).get(MAP_TIMEOUT)
    dt = time.perf_counter() - t0
    if len(out) != len(items):
        raise RuntimeError(f"map returned {len(out)} results for {len(items)} items")
    return dt


def wait_all_ready(pool: Any, n: int, task_seconds: float, timeout: float = READY_TIMEOUT) -> float:
    """Map ``pid_after`` until ``n`` distinct workers have answered; return the time taken."""
    t0 = time.perf_counter()
    seen: set[int] = set()
    while len(seen) < n:
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"only {len(seen)} of {n} workers answered within {timeout:.0f} s")
        seen.update(pool.map_async(pid_after, [task_seconds] * (2 * n), 1).get(MAP_TIMEOUT))
    return time.perf_counter() - t0


def close_pool(pool: Any) -> None:
    pool.close()
    pool.join()
    gc.collect()


def worker_pids(pool: Any) -> list[int]:
    return [p.pid for p in pool._pool if isinstance(p.pid, int)]


def cpu_seconds(pids: list[int]) -> tuple[float, float, float]:
    """The machine's busy CPU seconds so far (``/proc/stat``), this process's, and those of
    ``pids``: over a map, the first less the other two is what other programs took meanwhile
    (the load average cannot tell, since it counts the pool's own workers)."""
    from task_cpu import busy_seconds, pid_cpu  # this folder's (sys.path[0]); in the parent only

    return busy_seconds(), time.process_time(), sum(map(pid_cpu, pids))


def pss_mib(pids: list[int]) -> float | None:
    """Sum of the proportional set size of ``pids`` (Linux), in MiB."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            return None
    return total / 1024


# -- the sleep floor --------------------------------------------------------------------


def sleep_floor(seconds: float, batch: int) -> float:
    """Time for one process to sleep ``batch`` times ``seconds``, divided by the workers.

    Sampled: up to ``FLOOR_BUDGET`` seconds of sleeps (at least one), scaled to the batch.
    """
    k = max(1, min(batch, round(FLOOR_BUDGET / seconds)))
    t0 = time.perf_counter()
    for _ in range(k):
        time.sleep(seconds)
    return (time.perf_counter() - t0) / k * batch / WORKERS


# -- one repetition -----------------------------------------------------------------------


def cold_start(lib: str) -> float:
    out = subprocess.run([sys.executable, "-c", COLD_START, lib, str(WORKERS)], check=True,
                         capture_output=True, text=True, timeout=READY_TIMEOUT)
    return float(out.stdout.split()[0])


def one_turn(lib: str, results: dict) -> None:
    """One library's turn in a repetition: start, warm-up, the sleep batches, throughput."""
    t0 = time.perf_counter()
    pool = make_pool(lib, WORKERS)
    pool.apply(noop)
    results[("start", "first result")][lib].append(time.perf_counter() - t0)
    try:
        wait_all_ready(pool, WORKERS, 0.02)
        pool.map(sleep_task, [0.0] * (2 * WORKERS))  # ship the functions, once per worker
        pool.map(noop, range(2 * WORKERS))
        for seconds, batch in CASES:
            items = [seconds] * batch
            results[("sleep", seconds)][lib].append(timed_map(pool, sleep_task, items))
            if lib == MP:
                results[("sleep", seconds)]["mp-c1"].append(timed_map(pool, sleep_task, items, 1))
        for chunksize, samples in TINY_SAMPLES.items():
            for _ in range(samples):
                dt = timed_map(pool, noop, list(range(TINY_TASKS)), chunksize)
                results[("tiny", chunksize)][lib].append(TINY_TASKS / dt)
    finally:
        close_pool(pool)


def run_reps(reps: int, results: dict) -> None:
    for r in range(reps):
        t = time.perf_counter()
        for i, lib in enumerate(order(r)):
            one_turn(lib, results)
            results[("start", "cold")][lib].append(cold_start(lib))
            if i == 0:  # the floor between the two turns, so that it shares their conditions
                for seconds, batch in CASES:
                    results[("sleep", seconds)]["floor"].append(sleep_floor(seconds, batch))
        print(f"repetition {r + 1}/{reps}: {time.perf_counter() - t:.1f} s "
              f"(load average {os.getloadavg()[0]:.2f})", file=sys.stderr)


# -- the scale run ----------------------------------------------------------------------


def scale_run(lib: str, n: int, noop_tasks: int, sleep_per_worker: int, maps: int = 1) -> dict[str, Any]:
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    pool = make_pool(lib, n)
    out["Pool() returns (s)"] = time.perf_counter() - t0
    try:
        pool.apply_async(noop).get(READY_TIMEOUT)
        out["start to first result (s)"] = time.perf_counter() - t0
        wait_all_ready(pool, n, 0.1)
        out[f"start to all {n} workers ran a task (s)"] = time.perf_counter() - t0
        mem = pss_mib(worker_pids(pool))
        if mem is not None:
            out["workers' memory, sum of PSS (MiB)"] = mem
        pool.map(sleep_task, [0.0] * (2 * n))
        pool.map(noop, range(2 * n))
        dt = timed_map(pool, noop, list(range(noop_tasks)))
        out[f"{noop_tasks:,} no-op tasks, default chunksize (tasks/s)"] = noop_tasks / dt
        k = n * sleep_per_worker
        pids = worker_pids(pool)
        before = cpu_seconds(pids)
        times = [timed_map(pool, sleep_task, [0.01] * k) for _ in range(maps)]
        busy, parent, workers = (b - a for a, b in zip(before, cpu_seconds(pids)))
        out[OTHERS] = max(0.0, busy - parent - workers) / sum(times)
        out["CPU per task in those maps: the program (the master) (us)"] = parent / (k * maps) * 1e6
        out["CPU per task in those maps: the workers (us)"] = workers / (k * maps) * 1e6
        out[TEN_MS_EACH] = [k / dt for dt in times]
        out[f"{k:,} tasks of 10 ms, default chunksize (tasks/s; ideal {n / 0.01:,.0f})"] = out[TEN_MS] = k / med(times)
        dt = timed_map(pool, sleep_task, [0.01] * k, 1)
        out[f"{k:,} tasks of 10 ms, chunksize=1 (tasks/s; ideal {n / 0.01:,.0f})"] = k / dt
    finally:
        t = time.perf_counter()
        close_pool(pool)
        out["close() + join() (s)"] = time.perf_counter() - t
    return out


# -- report -------------------------------------------------------------------------------


def med(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float], scale: float = 1.0, digits: int = 3) -> str:
    return f"{min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f}"


def duration_label(seconds: float) -> str:
    return f"{seconds:g} s" if seconds >= 1 else f"{seconds * 1e3:g} ms"


def report(results: dict, scale: dict[str, dict[str, Any]], scale_errors: dict[str, str],
           n_scale: int, command: str, reps: int, elapsed: float, load: tuple[float, float],
           stale: list[str], scale_rounds: int = 1, rounds: list[dict[str, Any]] | None = None) -> None:
    checks: list[tuple[str, bool]] = []
    print()
    print(f"Command: `{command}`")
    print()
    print(f"Python {platform.python_version()} on {platform.system()} {platform.machine()}, "
          f"{os.cpu_count()} CPUs, affinity {sorted(os.sched_getaffinity(0))}; fiber backend "
          f"`{_backend_name()}`; multiprocessing start method `spawn`; {WORKERS} workers; medians "
          f"over {reps} interleaved repetitions (scale: {scale_rounds} each); load average {load[0]:.2f} at the start, "
          f"{load[1]:.2f} at the end; {elapsed:.0f} s in all.")
    if stale and sys.dont_write_bytecode:
        print()
        print(f"Note: PYTHONDONTWRITEBYTECODE is set and {len(stale)} fiber_core module(s) have "
              f"stale bytecode ({', '.join(stale[:4])}{', ...' if len(stale) > 4 else ''}): every "
              f"fiber worker compiled them at start. `python -m compileall fiber_core` first.")
    print()
    if reps:  # not with --scale-only
        print("### Framework overhead: time to finish a batch whose ideal time is 1 s")
        print()
        print("| task | batch | sleep floor (s) | fiber (s) | multiprocessing (s) | fiber / mp "
              "| fiber / floor | mp / floor | mp chunksize=1 (s) | fiber range | mp range |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for seconds, batch in CASES:
            row = results[("sleep", seconds)]
            fl, f, m, c1 = (med(row[k]) for k in ("floor", FIBER, MP, "mp-c1"))
            print(f"| {duration_label(seconds)} | {batch} | {fl:.4f} | {f:.4f} | {m:.4f} | {f / m:.3f} "
                  f"| {f / fl:.3f} | {m / fl:.3f} | {c1:.4f} | {spread(row[FIBER])} | {spread(row[MP])} |")
            checks.append((f"{duration_label(seconds)} tasks: fiber median <= multiprocessing median "
                           f"({f:.4f} s vs {m:.4f} s)", f <= m))
        print()
        print("sleep floor = one process's time for the whole batch of sleeps / 5 workers. "
              "Ratios are medians' ratios.")
        print()
        print(f"### Tiny tasks: {TINY_TASKS:,} no-op tasks through `map`, {WORKERS} workers")
        print()
        print("| chunksize | fiber (tasks/s) | multiprocessing (tasks/s) | time ratio fiber / mp "
              "| fiber range | mp range |")
        print("|---|---:|---:|---:|---:|---:|")
        for chunksize in (None, 1):
            row = results[("tiny", chunksize)]
            f, m = med(row[FIBER]), med(row[MP])
            label = "default" if chunksize is None else str(chunksize)
            print(f"| {label} | {f:,.0f} | {m:,.0f} | {m / f:.2f} | {spread(row[FIBER], 1, 0)} "
                  f"| {spread(row[MP], 1, 0)} |")
            checks.append((f"tiny tasks, chunksize={label}: fiber at least multiprocessing's "
                           f"throughput ({f:,.0f} vs {m:,.0f} tasks/s)", f >= m))
        print()
        print(f"### Pool start to first result: `Pool({WORKERS})` + `apply(noop)`")
        print()
        print("| | fiber (ms) | multiprocessing (ms) | fiber / mp | fiber range | mp range |")
        print("|---|---:|---:|---:|---:|---:|")
        for key, label in (("first result", "warm: in this process"),
                           ("cold", "cold: fresh interpreter, import included")):
            row = results[("start", key)]
            f, m = med(row[FIBER]), med(row[MP])
            print(f"| {label} | {f * 1e3:.1f} | {m * 1e3:.1f} | {f / m:.2f} "
                  f"| {spread(row[FIBER], 1e3, 1)} | {spread(row[MP], 1e3, 1)} |")
            checks.append((f"pool start to first result, {label.split(':')[0]}: fiber no slower than "
                           f"multiprocessing ({f * 1e3:.1f} vs {m * 1e3:.1f} ms)", f <= m))
    if scale or scale_errors:
        print()
        print(f"### Scale: {n_scale} local workers, one master (medians of {scale_rounds} runs each)")
        print()
        libs = [lib for lib in (FIBER, MP) if lib in scale or lib in scale_errors]
        print("| metric | " + " | ".join(libs) + " |")
        print("|---|" + "---:|" * len(libs))
        metrics: list[str] = []
        for lib in libs:
            metrics += [k for k in scale.get(lib, {}) if k not in metrics]
        for key in metrics:
            cells = []
            for lib in libs:
                v = scale.get(lib, {}).get(key)
                cells.append("-" if v is None else (f"{v:,.0f}" if v >= 100 else f"{v:.2f}"))
            print(f"| {key} | " + " | ".join(cells) + " |")
        for lib, err in scale_errors.items():
            print(f"\n{lib} scale run failed: {err}")
        checks += scale_rounds_report(rounds or [], n_scale)
    print()
    print("Targets:")
    for what, ok in checks:
        print(f"- {'PASS' if ok else 'FAIL'} {what}")


def scale_rounds_report(rounds: list[dict[str, Any]], n: int) -> list[tuple[str, bool]]:
    """Each scale round's map of 10 ms tasks, the two libraries side by side; the target: fiber
    ahead in every round. (Only the map is timed, on a started and warmed pool: each library's
    start is the "start to all workers" row above.)"""
    both = [r for r in rounds if FIBER in r and MP in r]
    if not both:
        return []
    print()
    print(f"### Scale rounds: {n} workers, the maps of 10 ms tasks (default chunksize) in each round, "
          "and their median")
    print()
    print("| round | order | fiber (tasks/s) | multiprocessing (tasks/s) | fiber / mp | fiber ahead "
          "| each map, fiber against mp (thousand tasks/s) | start to all ran a task, fiber / mp (s) "
          "| load average at each start | CPUs other programs took in the maps |")
    print("|---:|---|---:|---:|---:|---|---|---:|---:|---:|")
    ahead = 0
    ready = f"start to all {n} workers ran a task (s)"
    for i, r in enumerate(both, 1):
        f, m = r[FIBER][TEN_MS], r[MP][TEN_MS]
        ahead += f >= m
        each = " against ".join(" / ".join(f"{x / 1e3:.1f}" for x in r[lib][TEN_MS_EACH]) for lib in (FIBER, MP))
        print(f"| {i} | {', '.join(r['order'])} | {f:,.0f} | {m:,.0f} | {f / m:.3f} | {'yes' if f >= m else 'no'} "
              f"| {each} | {r[FIBER][ready]:.2f} / {r[MP][ready]:.2f} | {r[f'load {FIBER}']:.2f} / {r[f'load {MP}']:.2f} "
              f"| {r[FIBER][OTHERS]:.2f} / {r[MP][OTHERS]:.2f} |")
    return [(f"{n} workers, 10 ms tasks: fiber at least multiprocessing's throughput in every round "
             f"({ahead} of {len(both)})", ahead == len(both))]


def stale_bytecode() -> list[str]:
    """fiber_core modules whose cached bytecode is missing or older than the source.

    With ``PYTHONDONTWRITEBYTECODE`` set, every new process (each worker) compiles those
    again, which inflates fiber's start times; an installed package has fresh bytecode.
    """
    import importlib.util

    import fiber_core

    stale = []
    for folder, _dirs, files in os.walk(os.path.dirname(fiber_core.__file__)):
        for name in files:
            if name.endswith(".py"):
                src = os.path.join(folder, name)
                pyc = importlib.util.cache_from_source(src)
                if not os.path.exists(pyc) or os.path.getmtime(pyc) < os.path.getmtime(src):
                    stale.append(os.path.relpath(src, os.path.dirname(os.path.dirname(src))))
    return sorted(stale)


def _backend_name() -> str:
    from fiber_core.runtime.run import runtime

    return runtime().backend.name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (under a minute)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 5; 1 with --quick)")
    parser.add_argument("--skip-scale", action="store_true", help="no scale run")
    parser.add_argument("--scale-workers", type=int, default=None,
                        help="workers in the scale run (default 256; 32 with --quick)")
    parser.add_argument("--scale-fiber-only", action="store_true",
                        help="run the scale run with fiber only")
    parser.add_argument("--scale-only", action="store_true", help="the scale run only")
    parser.add_argument("--scale-rounds", type=int, default=1,
                        help="scale runs of each library, alternating which goes first (medians)")
    parser.add_argument("--scale-maps", type=int, default=5,
                        help="maps of 10 ms tasks timed on each scale run's pool; its figure is their median")
    args = parser.parse_args(argv)
    reps = args.reps if args.reps is not None else (1 if args.quick else 5)
    if reps < 1:
        parser.error("--reps must be at least 1")
    if args.scale_only and args.skip_scale:
        parser.error("--scale-only and --skip-scale exclude each other")
    if args.scale_rounds < 1:
        parser.error("--scale-rounds must be at least 1")
    if args.scale_maps < 1:
        parser.error("--scale-maps must be at least 1")
    if args.scale_only:
        reps = 0
    n_scale = args.scale_workers or (32 if args.quick else 256)
    noop_tasks = 20_000 if args.quick else 100_000
    sleep_per_worker = 10 if args.quick else 40

    results: dict[tuple[str, Any], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    load0 = os.getloadavg()[0]
    stale = stale_bytecode()
    started = time.perf_counter()
    run_reps(reps, results)
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    scale_errors: dict[str, str] = {}
    rounds: list[dict[str, Any]] = []
    if not args.skip_scale:
        libs = [FIBER] if args.scale_fiber_only else [FIBER, MP]
        for r in range(args.scale_rounds):
            this: dict[str, Any] = {"order": libs if r % 2 == 0 else libs[::-1]}
            for lib in this["order"]:
                if lib in scale_errors:
                    continue
                t = time.perf_counter()
                this[f"load {lib}"] = os.getloadavg()[0]
                try:
                    this[lib] = scale_run(lib, n_scale, noop_tasks, sleep_per_worker, args.scale_maps)
                    runs[lib].append(this[lib])
                except Exception as e:
                    scale_errors[lib] = f"{type(e).__name__}: {e}"
                print(f"scale run {r + 1}, {lib}: {time.perf_counter() - t:.1f} s "
                      f"(load average {this[f'load {lib}']:.2f} at its start)", file=sys.stderr)
            rounds.append(this)
    scale = {lib: {k: med([run[k] for run in done if k in run]) for k in done[0] if k not in (TEN_MS, TEN_MS_EACH)}
             for lib, done in runs.items() if done}
    command = shlex.join(["python", os.path.relpath(sys.argv[0]), *sys.argv[1:]])
    stale = sorted(set(stale) | set(stale_bytecode()))
    report(results, scale, scale_errors, n_scale, command, reps, time.perf_counter() - started,
           (load0, os.getloadavg()[0]), stale, args.scale_rounds, rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
