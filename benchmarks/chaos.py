"""Chaos: a Pool's maps while its workers are killed or preempted, against the same map undisturbed.

Every 0.1-0.3 s (``--every``) a random worker of the pool is hit:

* ``--mode kill``: SIGKILL (a crash, an out-of-memory kill as the platform may show it);
* ``--mode preempt``: SIGTERM, then SIGKILL after ``--grace`` seconds if it still
  runs, as a platform preempting a node does (a spot notice, a pod's deletion).

Each run is a 10,000-task map (1-5 ms tasks) through ``map``, ``imap``,
``imap_unordered`` or ``apply_async`` (``--api``), checked for every result exactly
once and in order. With ``--mode preempt`` the pool is made with ``task_losses=1``,
so a single death charged to a task fails the run: preemptions must charge none.
The undisturbed map is timed in the same pool, interleaved; medians are printed.

Backends: ``local`` (signals to the worker's process) and ``docker`` (the signal
goes to the container through the Docker API: ``DOCKER_HOST`` and
``FIBER_DOCKER_IMAGE`` must name a daemon and an image with Fiber).

``--fresh`` is the run a new user writes: each run a new
``Pool(workers)`` with its defaults, one ``map`` of CPU-bound 1-5 ms tasks, a random
process of ``pool._pool`` (starting workers too) SIGKILLed every ``--every`` seconds;
each run's outcome (exact, or the error that ended it), time and kills are printed,
then how many finished exact and why the others did not.

Usage::

    python benchmarks/chaos.py --runs 10                    # local, kill, every API
    python benchmarks/chaos.py --mode preempt --backend docker --runs 3 --api map
    python benchmarks/chaos.py --fresh --runs 30            # a new Pool(8) per run, 30 runs
    python benchmarks/chaos.py --fresh --runs 10 --every 0.05 0.1   # the stress figure
    python benchmarks/chaos.py --fresh --runs 10 --every 0.05 0.1 --loss-limit 100000
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fiber_core  # noqa: E402
from fiber_core.parallel.pool import Pool  # noqa: E402


def task(x: int) -> int:
    time.sleep(0.001 + (x % 5) * 0.001)  # the work itself: 1-5 ms
    return x


def cpu_task(x: int) -> int:
    end = time.thread_time() + 0.001 + (x % 5) * 0.001  # the work itself: 1-5 ms of CPU
    while time.thread_time() < end:
        pass
    return x


class AnyKill:
    """A thread that SIGKILLs a random process of ``pool._pool`` (starting ones too)."""

    def __init__(self, pool: Pool, every: tuple[float, float], seed: int) -> None:
        self.pool, self.every, self.rng = pool, every, random.Random(seed)
        self.stop = threading.Event()
        self.hits = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.rng.uniform(*self.every)):
            pids = [p.pid for p in self.pool._pool if p.pid is not None]
            if pids:
                try:
                    os.kill(self.rng.choice(pids), signal.SIGKILL)
                    self.hits += 1
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def fresh_runs(args: argparse.Namespace) -> None:
    """``--runs`` runs, a new Pool each time with its defaults, a CPU-bound map, SIGKILLs."""
    print(f"local, SIGKILL of any process of pool._pool every {args.every[0]:g}-{args.every[1]:g} s, "
          f"a new Pool({args.workers}) per run, map of {args.tasks} CPU-bound tasks of 1-5 ms\n")
    print("| run | outcome | seconds | kills |")
    print("|---:|---|---:|---:|")
    expected = list(range(args.tasks))
    outcomes: dict[str, int] = {}
    times, kills = [], []
    for run in range(args.runs):
        limit = {} if args.loss_limit is None else {"loss_limit": (args.loss_limit, 600.0)}
        with Pool(args.workers, **limit) as pool:
            chaos = AnyKill(pool, tuple(args.every), seed=run)
            start = time.perf_counter()
            try:
                outcome = "exact" if pool.map(cpu_task, range(args.tasks)) == expected else "WRONG RESULTS"
            except Exception as e:
                outcome = f"{type(e).__name__}: {str(e)[:160]}"
            elapsed = time.perf_counter() - start
            chaos.close()
        key = outcome.split(":")[0] if outcome != "exact" else outcome
        outcomes[key] = outcomes.get(key, 0) + 1
        times.append(elapsed)
        kills.append(chaos.hits)
        print(f"| {run + 1} | {outcome} | {elapsed:.1f} | {chaos.hits} |", flush=True)
    print(f"\n{outcomes.get('exact', 0)}/{args.runs} exact; outcomes: {outcomes}; median "
          f"{statistics.median(times):.1f} s, {statistics.median(kills):g} kills per run")


class Chaos:
    """A thread that hits a random worker every ``every`` seconds until stopped."""

    def __init__(self, pool: Pool, backend: str, mode: str, every: tuple[float, float],
                 grace: float, seed: int) -> None:
        self.pool, self.backend, self.mode, self.every, self.grace = pool, backend, mode, every, grace
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.hits = 0
        self.api = None
        if backend == "docker":
            import docker  # only for the docker backend

            self.api = docker.APIClient(base_url=os.environ["DOCKER_HOST"], timeout=60)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _signal(self, process: fiber_core.Process, sig: int) -> None:
        try:
            if self.api is not None:
                job = process.job
                if job is not None:
                    self.api.kill(job.id, signal=int(sig))
            elif process.pid is not None:
                os.kill(process.pid, sig)
        except Exception:
            pass  # it ended already

    def _run(self) -> None:
        while not self.stop.wait(self.rng.uniform(*self.every)):
            with self.pool._lock:
                workers = [w.process for w in self.pool._workers.values()
                           if not w.lost and not w.draining and w.process.pid is not None]
            if not workers:
                continue
            victim = self.rng.choice(workers)
            self.hits += 1
            if self.mode == "kill":
                self._signal(victim, signal.SIGKILL)
            else:
                self._signal(victim, signal.SIGTERM)
                threading.Timer(self.grace, self._signal, (victim, signal.SIGKILL)).start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def run_once(pool: Pool, api: str, n: int) -> list[int]:
    if api == "map":
        return pool.map(task, range(n))
    if api == "imap":
        return list(pool.imap(task, range(n)))
    if api == "imap_unordered":
        return sorted(pool.imap_unordered(task, range(n)))
    results = [pool.apply_async(task, (i,)) for i in range(n)]
    return [r.get() for r in results]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="local", choices=("local", "docker"))
    ap.add_argument("--mode", default="kill", choices=("kill", "preempt"))
    ap.add_argument("--api", default="all", choices=("all", "map", "imap", "imap_unordered", "apply_async"))
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--tasks", type=int, default=10_000)
    ap.add_argument("--runs", type=int, default=3, help="disturbed runs per API")
    ap.add_argument("--every", type=float, nargs=2, default=(0.1, 0.3))
    ap.add_argument("--grace", type=float, default=2.0)
    ap.add_argument("--loss-limit", type=int, default=None,
                    help="with --fresh: the pools' loss_limit count (default: the Pool's own)")
    ap.add_argument("--fresh", action="store_true", help="a new Pool per run, with its defaults, a CPU-bound map")
    args = ap.parse_args()
    if args.fresh:
        fresh_runs(args)
        return
    apis = ["map", "imap", "imap_unordered", "apply_async"] if args.api == "all" else [args.api]
    losses = 1 if args.mode == "preempt" else 3
    print(f"{args.backend}, {args.mode} every {args.every[0]:g}-{args.every[1]:g} s, Pool({args.workers}), "
          f"{args.tasks} tasks of 1-5 ms, task_losses={losses}\n")
    print("| api | runs exact | hits (median) | undisturbed (s) | disturbed (s) | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    expected = list(range(args.tasks))
    # Many losses on purpose: the pool-wide limit (loss_limit) must not end the benchmark.
    with Pool(args.workers, backend=args.backend, task_losses=losses, loss_limit=(100_000, 600.0)) as pool:
        pool.map(task, range(args.workers * 4))
        for api in apis:
            calm, wild, hits, exact = [], [], [], 0
            for run in range(args.runs):
                start = time.perf_counter()
                ok = run_once(pool, api, args.tasks) == expected
                calm.append(time.perf_counter() - start)
                chaos = Chaos(pool, args.backend, args.mode, tuple(args.every), args.grace, seed=run)
                start = time.perf_counter()
                try:
                    ok = run_once(pool, api, args.tasks) == expected and ok
                except Exception as e:
                    ok = False
                    print(f"  {api} run {run + 1} failed: {e!r}", file=sys.stderr)
                finally:
                    wild.append(time.perf_counter() - start)
                    chaos.close()
                hits.append(chaos.hits)
                exact += ok
            c, w = statistics.median(calm), statistics.median(wild)
            print(f"| {api} | {exact}/{args.runs} | {statistics.median(hits):g} | {c:.2f} | {w:.2f} | {w / c:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
