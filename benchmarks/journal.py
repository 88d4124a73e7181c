"""What a journal costs (docs/durable.md): the same maps with and without one, interleaved.

Two cases, on a pool of 5 workers:

* the paper's 1 ms batch: 5,000 tasks that sleep 1 ms, ``map`` with its default
  chunksize (ideal: 1 s);
* a no-op ``map`` of 20,000 items at ``chunksize=1``: 20,000 units, the journal's worst
  case (a record per batch of results, the identity and digest of every unit).

Each repetition runs each side in a fresh program (the journal is the program's: it
is opened on its first call), in an order that flips every repetition; a program
with a journal starts on an empty directory (a journal that holds the run would
replay it instead of running it). A program starts its pool, warms it up (a map until
every worker answered), then times each case once. Figures are medians over the
repetitions; the ratio is with / without.

Usage::

    python benchmarks/journal.py              # 7 repetitions, about a minute and a half
    python benchmarks/journal.py --reps 3     # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

WORKERS = 5
SLEEP_TASKS, SLEEP_SECONDS = 5000, 0.001
NOOP_TASKS = 20_000

PROGRAM = """
import json, os, sys, time
import fiber_core

def nap(x):
    time.sleep(%(sleep)r)

def noop(x):
    return x

def pid_after(seconds):
    time.sleep(seconds)
    return os.getpid()

if __name__ == "__main__":
    with fiber_core.Pool(%(workers)d) as pool:
        seen = set()
        while len(seen) < %(workers)d:
            seen.update(pool.map(pid_after, [0.01] * %(workers)d * 2, 1))
        pool.map(noop, range(100), 1)
        t0 = time.perf_counter()
        pool.map(nap, range(%(sleeps)d))
        t1 = time.perf_counter()
        out = pool.map(noop, range(%(noops)d), 1)
        t2 = time.perf_counter()
        assert out == list(range(%(noops)d))
    print(json.dumps({"sleep_batch": t1 - t0, "noop_chunksize1": t2 - t1}))
"""


def run_once(path: str, journal: str | None) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "FIBER_JOURNAL"}
    if journal is not None:
        env["FIBER_JOURNAL"] = journal
    proc = subprocess.run([sys.executable, path], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"the benchmark program failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="fiber-bench-journal-")
    path = os.path.join(work, "program.py")
    with open(path, "w") as f:
        f.write(PROGRAM % {"sleep": SLEEP_SECONDS, "workers": WORKERS, "sleeps": SLEEP_TASKS,
                           "noops": NOOP_TASKS})
    times: dict[str, dict[str, list[float]]] = {"without": {}, "with": {}}
    journal_bytes = []
    try:
        for r in range(args.reps):
            for side in (("without", "with") if r % 2 == 0 else ("with", "without")):
                journal = None
                if side == "with":
                    journal = os.path.join(work, f"journal-{r}")
                got = run_once(path, journal)
                if journal is not None:
                    journal_bytes.append(os.path.getsize(os.path.join(journal, "journal")))
                    shutil.rmtree(journal)
                for case, seconds in got.items():
                    times[side].setdefault(case, []).append(seconds)
            print(f"repetition {r + 1}/{args.reps} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"journal cost, {WORKERS} workers, medians of {args.reps} interleaved repetitions "
          f"({time.strftime('%Y-%m-%d')}, python {sys.version.split()[0]}, {os.cpu_count()} CPUs)")
    print(f"{'case':<34}{'without':>10}{'with':>10}{'ratio':>8}")
    names = {"sleep_batch": f"{SLEEP_TASKS} x {SLEEP_SECONDS * 1000:g} ms sleep, map",
             "noop_chunksize1": f"{NOOP_TASKS} no-ops, map chunksize=1"}
    for case, name in names.items():
        without = statistics.median(times["without"][case])
        with_ = statistics.median(times["with"][case])
        print(f"{name:<34}{without:>9.3f}s{with_:>9.3f}s{with_ / without:>8.3f}")
    print(f"journal size after a run: {statistics.median(journal_bytes) / 1e6:.2f} MB (median)")


if __name__ == "__main__":
    main()
