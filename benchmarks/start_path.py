"""How far a Process.start() travels, and where a template-forked worker's start time goes.

Without arguments: traces every Python call made by ``Process.start()`` on the local
backend, up to the moment the backend's ``create_job`` is entered, and counts the calls
that cross from one ``fiber_core`` module into another, and how many times each module is
entered. The first start of a process pays for selecting the backend; later ones should not.

With ``--breakdown``: runs ``Pool(n)`` (until all n workers ran a task, as
``local_start.py`` measures it) in a program of its own, several times, and splits each
worker's start into its phases: the template's fork (from the parent's request to the
worker's ``main()``), the connection to the parent (connect and handshake), the prelude
(waiting for it, then applying it: ``sys.path``, the main module), the process object,
the connection to the pool, the initializer, the first task. This module is the
template's preload (``local_preload``): it wraps the worker's steps in the template,
so every forked worker records when each step ended, on the system's monotonic clock
(the parent's too) and in CPU seconds of its own (a forked child's CPU count starts
at 0, so a loaded machine changes the wall times, not these). Medians over the workers
of every run.

    python benchmarks/start_path.py
    python benchmarks/start_path.py --breakdown -n 64 --runs 3
    python benchmarks/start_path.py --breakdown -n 64 --against ../base   # the base's fiber_core
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from types import FrameType
from typing import Any

import fiber_core


def _noop() -> None:
    pass


def trace_start() -> tuple[int, collections.Counter[str]]:
    crossings = 0
    entered: collections.Counter[str] = collections.Counter()
    stack: list[str] = []
    done = False

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal crossings, done
        if done:
            return
        module = frame.f_globals.get("__name__", "")
        if event == "call":
            caller = stack[-1] if stack else ""
            stack.append(module)
            if module.startswith("fiber_core") and caller.startswith("fiber_core") and module != caller:
                crossings += 1
                entered[module] += 1
            if frame.f_code.co_name == "create_job":
                done = True
        elif event == "return" and stack:
            stack.pop()

    p = fiber_core.Process(target=_noop)
    sys.setprofile(profile)
    try:
        p.start()
    finally:
        sys.setprofile(None)
    p.join(60)
    return crossings, entered


# -- the breakdown -------------------------------------------------------------------------

PHASES = (
    ("fork", "main", "the template's fork, to the worker's main()"),
    ("connect", "connected", "connect and handshake to the parent"),
    ("wait prelude", "prelude", "until the prelude arrives"),
    ("apply prelude", "applied", "sys.path, argv, config, the main module"),
    ("process object", "loaded", "until the process object is received and unpickled"),
    ("pool connect", "pool", "connect and handshake to the pool"),
    ("initializer", "initialized", "the Pool's initializer"),
    ("first task", "task", "until the first task runs"),
)

_marks: list[tuple[str, float, float]] = []


def _store() -> list[tuple[str, float, float]]:
    """The marks of this worker: the preloaded module's (the program's main module, which
    this file is too, is another copy of it in a worker)."""
    return getattr(sys.modules.get("start_path"), "_marks", _marks)


def _mark(name: str) -> None:
    _store().append((name, time.monotonic(), time.process_time()))


def _wrap(module: Any, attr: str, before: str | None = None, after: str | None = None) -> None:
    inner = getattr(module, attr)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if before:
            _mark(before)
        out = inner(*args, **kwargs)
        if after:
            _mark(after)
        return out

    setattr(module, attr, wrapper)


def _install_in_template() -> None:
    """In the template (this module is its preload): wrap the worker's steps."""
    from fiber_core.parallel.pool import worker as pool_worker
    from fiber_core.processes import worker

    _wrap(worker, "main", before="main")
    _wrap(worker, "_parent_connection" if hasattr(worker, "_parent_connection") else "dial", after="connected")
    _wrap(worker, "decode_process_prelude", before="prelude")
    _wrap(worker, "_apply_prelude", after="applied")
    _wrap(worker, "decode_process_object", after="loaded")
    _wrap(pool_worker, "dial", after="pool")


def probe_init(barrier: Any) -> None:
    """The Pool's initializer in the measured program."""
    global _barrier
    _barrier = barrier
    _mark("initialized")


def probe_task(x: int) -> int:
    """The measured task: its worker writes what it recorded, then waits for all the others."""
    _mark("task")
    where = os.environ["START_PATH_PROBES"]
    with open(os.path.join(where, f"{os.getpid()}.json"), "w") as f:
        json.dump(_store(), f)
    _barrier.wait(timeout=300)
    return x


def _in_template() -> bool:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", "") == "fiber_core.backends.template"


if __name__ == "start_path" and os.environ.get("START_PATH_PROBES") and _in_template():
    _install_in_template()


def _requested() -> dict[int, float]:
    """In the parent: when the template was asked for each job (pid -> monotonic time)."""
    from fiber_core.backends import template

    asked: dict[int, float] = {}
    start = template.Template.start

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        t = time.monotonic()
        out = start(self, *args, **kwargs)
        for job in out if isinstance(out, list) else [out]:  # (a list: a group's, sent at once)
            if hasattr(job, "pid"):
                asked[job.pid] = t
        return out

    template.Template.start = timed  # type: ignore[method-assign]
    return asked


def breakdown_run(n: int, pools: int) -> list[dict]:
    """In the measured program: ``pools`` Pools of n; for each, its start time and its workers' marks."""
    import fiber_core as mp

    mp.init(local_preload=["start_path"])
    asked = _requested()
    where = os.environ["START_PATH_PROBES"]
    out = []
    for _ in range(pools):
        for name in os.listdir(where):
            os.remove(os.path.join(where, name))
        asked.clear()
        barrier = mp.Barrier(n)
        start, cpu = time.monotonic(), time.process_time()
        pool = mp.Pool(n, initializer=probe_init, initargs=(barrier,))
        assert pool.map(probe_task, range(n), chunksize=1) == list(range(n))
        total, cpu = time.monotonic() - start, time.process_time() - cpu
        workers = []
        for name in os.listdir(where):
            pid = int(name.split(".")[0])
            with open(os.path.join(where, name)) as f:
                marks = {m: (t, cpu) for m, t, cpu in json.load(f)}
            if pid in asked:
                marks["asked"] = (asked[pid], 0.0)
            workers.append(marks)
        out.append({"start": start, "total": total, "cpu": cpu, "workers": workers})
        pool.terminate()
        pool.join()
    return out


def breakdown(n: int, runs: int, repo: str) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rows: list[list[dict]] = []
    with tempfile.TemporaryDirectory() as where:
        env = {**os.environ, "START_PATH_PROBES": where,
               "PYTHONPATH": os.pathsep.join([here, repo])}
        for _ in range(runs):
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--in-program", str(n)],
                                 env=env, capture_output=True, text=True, timeout=900, cwd=here)
            if out.returncode != 0:
                raise RuntimeError(out.stderr[-3000:])
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"Pool({n}) started from the template, {runs} programs, medians over the workers "
          f"(load average {os.getloadavg()[0]:.1f}):")
    for which, label in ((0, "first Pool"), (1, "second Pool")):
        pools = [r[which] for r in rows]
        workers = [w for p in pools for w in p["workers"]]
        print(f"  {label}: until all ran a task {statistics.median(p['total'] for p in pools):.3f} s, "
              f"the parent's CPU {statistics.median(p['cpu'] for p in pools) * 1000 / n:.2f} ms per worker; "
              f"{sum('asked' in w for w in workers)} of {len(workers)} workers forked from the template")
        print(f"    {'phase':16s} {'wall ms':>8s} {'cpu ms':>7s} {'ends at ms':>11s}")
        start = {id(w): p["start"] for p in pools for w in p["workers"]}
        marks = ["asked"] + [mark for _, mark, _ in PHASES]
        for k, (name, mark, what) in enumerate(PHASES):
            have = [(w, _before(w, marks[:k + 1])) for w in workers if mark in w]
            if not have:
                continue
            wall = statistics.median(1000 * (w[mark][0] - b[0]) for w, b in have)
            cpu = statistics.median(1000 * (w[mark][1] - b[1]) for w, b in have)
            at = statistics.median(1000 * (w[mark][0] - start[id(w)]) for w, _ in have)
            print(f"    {name:16s} {wall:8.2f} {cpu:7.2f} {at:11.1f}   {what}")


def _before(worker: dict, marks: list[str]) -> tuple[float, float]:
    """The latest of ``marks`` that the worker has (a step it skipped is part of the next)."""
    return next((worker[m] for m in reversed(marks) if m in worker), (0.0, 0.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--breakdown", action="store_true", help="where a forked worker's start time goes")
    ap.add_argument("-n", type=int, default=5, help="workers of the Pool (--breakdown)")
    ap.add_argument("--runs", type=int, default=3, help="programs measured (--breakdown)")
    ap.add_argument("--against", help="measure the fiber_core of this checkout instead (--breakdown)")
    ap.add_argument("--in-program", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.in_program:
        print(json.dumps(breakdown_run(args.in_program, 2)))
        return
    if args.breakdown:
        repo = os.path.abspath(args.against) if args.against else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        breakdown(args.n, args.runs, repo)
        return
    for label in ("first start", "second start"):
        crossings, entered = trace_start()
        modules = ", ".join(f"{m.removeprefix('fiber_core.')} {n}" for m, n in entered.most_common())
        print(f"{label}: {crossings} module crossings to create_job ({modules})")


if __name__ == "__main__":
    main()
