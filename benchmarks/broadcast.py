"""Broadcast: a big read-only table and per-generation weights reaching every local worker.

Each measure runs in a program of its own. A Pool of ``--workers`` is started and warmed
first (not timed); then the value is made available and every worker takes it (one task
per worker: each waits at a Barrier after reading, so all hold it at once) and touches one
float per page. Printed per method, medians over ``--rounds`` (methods alternate within a
round):

* ``time``: from the value being in the parent to every worker holding it;
* ``pss``: the proportional set size of the program's processes (parent, workers and
  whatever else it started) while all hold it, in GiB: what the machine spends;
* ``shm``: growth of ``/dev/shm`` use, in GiB.

``reads`` measures one reader of ``fiber_core.broadcast`` (a job on this host): the
first read of each new version (opened, checked, mapped, unpickled) and a read of a
version it already holds, over ``--generations`` versions.

``--against DIR`` runs every measure also with the ``fiber_core`` of the checkout ``DIR``
(a reference: the base commit of a change), alternating with this one, and prints its rows
after this one's, marked ``(ref)``.

Methods: ``broadcast`` (``fiber_core.broadcast``), ``shm-by-hand`` (``multiprocessing``
with fork and ``shared_memory``, the parent copying the table in), ``ray-put``
(``ray.put`` and one actor per worker, if Ray is installed), and the per-worker copies
users fall back on: ``fiber-arg`` (the array as a task argument, pickled per worker) and
``load`` (each worker ``np.load``-s it from a file). Per-worker copies of a 1 GiB table
for 64 workers do not fit in memory here, so they run with ``--copy-workers``.

    python benchmarks/broadcast.py table --mib 1024 --workers 64 --rounds 3
    python benchmarks/broadcast.py weights --mib 10 --workers 64 --generations 10
    python benchmarks/broadcast.py reads --mib 10 --generations 20 --rounds 5 --against ../base
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np

    _held = None

    def pss_of_tree(root):
        children = {}
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except OSError:
                    continue
                children.setdefault(ppid, []).append(int(pid))
        todo, total = [root], 0
        while todo:
            pid = todo.pop()
            todo += children.get(pid, [])
            try:
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    for line in f:
                        if line.startswith("Pss:"):
                            total += int(line.split()[1]) * 1024
            except OSError:
                pass
        return total

    def shm_used():
        st = os.statvfs("/dev/shm")
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def touch(arr):
        return float(arr.reshape(-1)[:: 4096 // arr.itemsize].sum())

    def init(barrier):
        global _barrier
        _barrier = barrier

    def meet(x):
        _barrier.wait(timeout=600)
        return x

    def take(arg):
        global _held
        kind, value = arg
        if kind == "broadcast":
            value = value.value
        elif kind == "shm":
            from multiprocessing import shared_memory
            global _segment
            _segment = shared_memory.SharedMemory(name=value[0])
            if sys.version_info < (3, 13):  # the usual workaround: only the parent owns it
                from multiprocessing import resource_tracker
                resource_tracker.unregister(_segment._name, "shared_memory")
            value = np.ndarray(value[1], dtype=np.float32, buffer=_segment.buf)
        elif kind == "load":
            value = np.load(value)
        _held = value
        touch(value)
        _barrier.wait(timeout=600)
        return 0

    def table(n, seed):
        return np.full(n, float(seed), dtype=np.float32)

    def reader(handle, ask, back):
        same = []
        while True:
            k = ask.get()
            if k is None:
                break
            start = time.perf_counter()
            handle.value  # a new version: opened, checked, mapped, unpickled
            new = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(k):
                handle.value  # the same version: only the current version number is read
            same.append((time.perf_counter() - start) / k)
            back.put(new)
        back.put(sorted(same)[len(same) // 2])

    def reads(n, rounds):
        import fiber_core
        handle = fiber_core.broadcast(table(n, 1))
        ask, back = fiber_core.Queue(), fiber_core.Queue()
        p = fiber_core.Process(target=reader, args=(handle, ask, back))
        p.start()
        new = []
        for g in range(rounds):
            handle.publish(table(n, g + 2))
            ask.put(2000)
            new.append(back.get(timeout=600))
        ask.put(None)
        same = back.get(timeout=600)
        p.join()
        print(json.dumps({"times": new, "same": same, "pss": 0, "shm": 0}))

    if __name__ == "__main__":
        what, method, mib, workers, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
        n = mib * 2**20 // 4
        base_shm = shm_used()
        if what == "reads":
            reads(n, rounds)
            sys.exit(0)
        if method == "ray-put":
            import ray
            ray.init(num_cpus=workers, include_dashboard=False, logging_level="ERROR")

            @ray.remote(num_cpus=1)
            class Holder:
                def take(self, value):
                    self.value = value
                    return touch(value)

            holders = [Holder.remote() for _ in range(workers)]
            ray.get([h.take.remote(np.zeros(1, np.float32)) for h in holders])  # warm
            times = []
            for g in range(rounds):
                value = table(n, g + 1)
                start = time.perf_counter()
                ref = ray.put(value)
                ray.get([h.take.remote(ref) for h in holders])
                times.append(time.perf_counter() - start)
                del ref
            pss = pss_of_tree(os.getpid())
            print(json.dumps({"times": times, "pss": pss, "shm": shm_used() - base_shm}))
            ray.shutdown()
            sys.exit(0)
        if method in ("shm-by-hand",):
            import multiprocessing as mp
            ctx = mp.get_context("fork")
        else:
            import fiber_core as ctx
        barrier = ctx.Barrier(workers)
        pool = ctx.Pool(workers, initializer=init, initargs=(barrier,))
        pool.map(meet, range(workers), chunksize=1)  # every worker started and ready
        times, handle, segment = [], None, None
        for g in range(rounds):
            value = table(n, g + 1)
            if method == "load":
                path = f"/tmp/fiber-bench-table-{os.getpid()}.npy"
                np.save(path, value)
            start = time.perf_counter()
            if method == "broadcast":
                if handle is None:
                    handle = ctx.broadcast(value)
                else:
                    handle.publish(value)
                arg = ("broadcast", handle)
            elif method == "shm-by-hand":
                from multiprocessing import shared_memory
                old, segment = segment, shared_memory.SharedMemory(create=True, size=value.nbytes)
                np.ndarray(value.shape, dtype=value.dtype, buffer=segment.buf)[:] = value
                arg = ("shm", (segment.name, value.shape))
            elif method == "fiber-arg":
                arg = ("array", value)
            elif method == "load":
                arg = ("load", path)
            assert pool.map(take, [arg] * workers, chunksize=1) == [0] * workers
            times.append(time.perf_counter() - start)
            if method == "shm-by-hand" and old is not None:
                old.close()
                old.unlink()
            if method == "load":
                os.unlink(path)
        pss = pss_of_tree(os.getpid())
        print(json.dumps({"times": times, "pss": pss, "shm": shm_used() - base_shm}))
        pool.terminate()
        pool.join()
        if segment is not None:
            segment.close()
            segment.unlink()
""")


HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(what: str, method: str, mib: int, workers: int, rounds: int, where: str, repo: str = HERE) -> dict:
    out = subprocess.run([sys.executable, where, what, method, str(mib), str(workers), str(rounds)],
                         capture_output=True, text=True, timeout=3600,
                         env={**os.environ, "PYTHONPATH": repo, "RAY_DEDUP_LOGS": "0"},
                         cwd=repo)  # jobs run `python -m`, which imports from the working directory first
    if out.returncode != 0:
        raise SystemExit(f"{method} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["table", "weights", "reads"])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--copy-workers", type=int, default=8, help="workers for the per-worker-copy methods")
    ap.add_argument("--rounds", type=int, default=3, help="programs per method (table, reads)")
    ap.add_argument("--generations", type=int, default=10, help="versions per program (weights, reads)")
    ap.add_argument("--methods", default="broadcast,shm-by-hand,ray-put,fiber-arg,load")
    ap.add_argument("--against", help="a checkout whose fiber_core is measured too, alternating")
    args = ap.parse_args()
    methods = ["broadcast"] if args.what == "reads" else args.methods.split(",")
    try:
        import ray  # noqa: F401
    except ImportError:
        if "ray-put" in methods:
            print("ray is not installed: ray-put skipped (pip install ray)")
            methods.remove("ray-put")
    where = "/tmp/fiber_bench_broadcast.py"
    with open(where, "w") as f:
        f.write(PROGRAM)
    repos = {"": HERE} | ({" (ref)": os.path.abspath(args.against)} if args.against else {})
    results: dict[str, list[dict]] = {m + tag: [] for m in methods for tag in repos}
    programs = args.rounds if args.what in ("table", "reads") else 1
    versions = 1 if args.what == "table" else args.generations
    for _ in range(programs):
        for m in methods:
            workers = args.copy_workers if args.what == "table" and m in ("fiber-arg", "load") else args.workers
            for tag, repo in repos.items():
                results[m + tag].append(measure(args.what, m, args.mib, workers, versions, where, repo))
    if args.what == "reads":
        print(f"reads: {args.mib} MiB float32, one reader, {args.generations} versions x {args.rounds} programs; medians")
        print(f"{'method':<20}{'new version ms':>16}{'same version us':>17}")
        for m, runs in results.items():
            new = statistics.median(t for r in runs for t in r["times"]) * 1e3
            same = statistics.median(r["same"] for r in runs) * 1e6
            print(f"{m:<20}{new:>16.3f}{same:>17.2f}")
        return
    copies = f" ({args.copy_workers} for per-worker copies)" if args.what == "table" else ""
    print(f"{args.what}: {args.mib} MiB float32, {args.workers} workers{copies}; medians")
    print(f"{'method':<20}{'workers':>8}{'time s':>10}{'first s':>10}{'pss GiB':>10}{'shm GiB':>10}")
    for m, runs in results.items():
        times = [t for r in runs for t in (r["times"][1:] or r["times"])]
        first = [r["times"][0] for r in runs]
        workers = args.copy_workers if args.what == "table" and m.split()[0] in ("fiber-arg", "load") else args.workers
        print(f"{m:<20}{workers:>8}{statistics.median(times):>10.3f}{statistics.median(first):>10.3f}"
              f"{statistics.median(r['pss'] for r in runs) / 2**30:>10.2f}"
              f"{statistics.median(r['shm'] for r in runs) / 2**30:>10.2f}")


if __name__ == "__main__":
    main()
