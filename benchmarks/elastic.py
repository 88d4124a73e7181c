"""Elastic pools: how fast a pool grows to its maximum under work and gives workers back when idle.

``local``: one ``map`` of 10 ms tasks on ``Pool(N, min_processes=1)``, timed from the
map's call, against a fixed ``Pool(N)`` (its start included, as a user who makes a pool
for the map pays it) and ``multiprocessing.Pool(N)`` (fork, start included). A thread
notes when the elastic pool first has 2, N/2 and N workers ready, and, after the map,
when it is back to its minimum (``idle_timeout``). Modes alternate; medians.

``kubernetes``: the same on the Kubernetes emulator of the tests (``scripts/test-services.sh
up k8s``) with 1-CPU workers on a node with room for half of them: the rest stay Pending
until, 3 s into the map, a node is added. The timeline shows the workers as the cluster
grants them.

    python benchmarks/elastic.py local -n 16 --tasks 2000 --rounds 3
    python benchmarks/elastic.py kubernetes -n 8 --tasks 1000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def work(x: int) -> int:
    time.sleep(0.01)
    return x


def ready_count(pool: Any) -> int:
    return sum(1 for w in list(pool._workers.values()) if w.ready and not w.retiring and not w.lost)


def watch(pool: Any, start: float, marks: dict[str, float], n: int, stop: threading.Event) -> None:
    while not stop.is_set():
        k = ready_count(pool)
        for name, want in (("2", 2), ("half", n // 2), ("all", n)):
            if k >= want and name not in marks:
                marks[name] = time.perf_counter() - start
        time.sleep(0.005)


def elastic_run(n: int, tasks: int, idle: float, **kwargs: Any) -> dict[str, float]:
    import fiber_core

    pool = fiber_core.Pool(n, min_processes=1, idle_timeout=idle, **kwargs)
    marks: dict[str, float] = {}
    stop = threading.Event()
    start = time.perf_counter()
    watcher = threading.Thread(target=watch, args=(pool, start, marks, n, stop), daemon=True)
    watcher.start()
    try:
        assert pool.map(work, range(tasks), chunksize=1) == list(range(tasks))
        marks["map"] = time.perf_counter() - start
        stop.set()
        end = time.perf_counter()
        while ready_count(pool) > 1 or len(pool._workers) > 1:
            time.sleep(0.01)
        marks["shrunk"] = time.perf_counter() - end
    finally:
        stop.set()
        pool.terminate()
        pool.join()
    return marks


def fixed_run(lib: str, n: int, tasks: int) -> dict[str, float]:
    if lib == "fiber":
        import fiber_core as ctx
    else:
        import multiprocessing

        ctx = multiprocessing.get_context("fork")  # type: ignore[assignment]
    start = time.perf_counter()
    with ctx.Pool(n) as pool:
        assert pool.map(work, range(tasks), chunksize=1) == list(range(tasks))
        took = time.perf_counter() - start
    return {"map": took}


def local(args: argparse.Namespace) -> None:
    rows: dict[str, list[dict[str, float]]] = {"elastic": [], "fiber fixed": [], "mp fork": []}
    for _ in range(args.rounds):
        rows["elastic"].append(elastic_run(args.n, args.tasks, args.idle))
        rows["fiber fixed"].append(fixed_run("fiber", args.n, args.tasks))
        rows["mp fork"].append(fixed_run("mp", args.n, args.tasks))
    ideal = args.tasks * 0.01 / args.n
    print(f"{args.tasks} tasks of 10 ms, {args.n} workers (ideal {ideal:.2f} s), medians of {args.rounds}; "
          f"seconds from the map's call")
    print(f"{'pool':<14}{'2 ready':>9}{'n/2 ready':>11}{'n ready':>9}{'map':>8}{'shrunk':>9}")
    for name, runs in rows.items():
        def med(key: str, runs: list[dict[str, float]] = runs) -> str:
            vals = [r[key] for r in runs if key in r]
            return f"{statistics.median(vals):.2f}" if vals else "-"
        print(f"{name:<14}{med('2'):>9}{med('half'):>11}{med('all'):>9}{med('map'):>8}{med('shrunk'):>9}")


def kubernetes(args: argparse.Namespace) -> None:
    services = Path(os.environ.get("FIBER_SERVICES_DIR", "/tmp/fiber-services"))
    kubeconfig = services / "k8s" / "kubeconfig"
    url = next(line.split()[1] for line in kubeconfig.read_text().splitlines() if "server:" in line)

    def admin(path: str, body: Any = None, method: str = "GET") -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{url}/_emulator/{path}", data=data, method=method)
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.load(resp)

    before = admin("config")
    os.environ.update(FIBER_KUBERNETES_KUBECONFIG=str(kubeconfig), FIBER_KUBERNETES_NAMESPACE="default",
                      FIBER_KUBERNETES_IMAGE="fiber-test:latest", FIBER_LISTEN_HOST="127.0.0.1",
                      FIBER_KUBERNETES_VOLUMES=f"{REPO}:{REPO}:ro")
    half = args.n // 2
    admin("config", {"nodes": [{"name": "first", "allocatable": {"cpu": str(half)}}]}, "PUT")
    timeline: list[tuple[float, int, int]] = []
    try:
        import fiber_core

        pool = fiber_core.Pool(args.n, min_processes=1, backend="kubernetes", cpu=1)
        start = time.perf_counter()
        stop = threading.Event()

        def note() -> None:
            last = None
            while not stop.is_set():
                ready = ready_count(pool)
                asked = sum(1 for w in list(pool._workers.values()) if not w.retiring and not w.lost)
                if (ready, asked) != last:
                    timeline.append((time.perf_counter() - start, ready, asked))
                    last = (ready, asked)
                time.sleep(0.01)

        def grant() -> None:
            if not stop.wait(3.0):
                admin("config", {"nodes": [{"name": "first", "allocatable": {"cpu": str(half)}},
                                           {"name": "added", "allocatable": {"cpu": str(args.n - half)}}]},
                      "PUT")
                timeline.append((time.perf_counter() - start, -1, -1))

        threads = [threading.Thread(target=f, daemon=True) for f in (note, grant)]
        for t in threads:
            t.start()
        assert pool.map(work, range(args.tasks), chunksize=1) == list(range(args.tasks))
        took = time.perf_counter() - start
        stop.set()
        pool.terminate()
        pool.join()
    finally:
        admin("config", {k: before[k] for k in ("rbac", "nodes")}, "PUT")
    print(f"{args.tasks} tasks of 10 ms on Pool({args.n}, min_processes=1), 1-CPU workers; a node with "
          f"room for {half}, a second node added at 3 s; map took {took:.2f} s")
    print(f"{'t (s)':>7}  workers ready / asked for (Pending included)")
    for t, ready, asked in timeline:
        print(f"{t:7.2f}  " + ("node added" if ready < 0 else f"{ready} / {asked}"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("where", choices=["local", "kubernetes"])
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("--tasks", type=int, default=2000)
    ap.add_argument("--idle", type=float, default=2.0, help="idle_timeout of the elastic pool")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    (local if args.where == "local" else kubernetes)(args)


if __name__ == "__main__":
    main()
