"""Scorecard: one workload under one seeded fault schedule per fault kind, against Fiber and its peers.

The workload is what Fiber is for: a ``map`` of ``--tasks`` CPU-bound tasks of 1-5 ms, then
an ES-like loop of ``--generations`` generations, each a ``map`` of ``--population``
CPU-bound tasks of 1 ms whose results decide the next generation's argument. Every library
runs it with ``--workers`` processes and the same chunk size (``--chunksize``), results
taken in order (``imap``, ``Executor.map``) where the library gives them in order, else
(Dask) as its futures complete.

Each fault kind has one schedule (``fiber_core.testing.faults.FaultSchedule``): a seed gives
``--faults`` faults (one for ``cut`` and ``loss``), each "after the k-th result, this kind,
this worker index", and the same seed is used for every library and backend, so each is
struck at the same points of the run. ``scoring.strike`` fires it: a thread reads the count
of results the program has taken and strikes the worker at that index (modulo the live
workers, in the order they started), its host or its platform (``scoring.kinds`` says what
each kind does, and which library or backend it cannot be produced for: ``n/a``, with the
reason as a footnote):

* ``none``: the undisturbed run, the reference for the others' time;
* ``kill``, ``term``, ``stop``: SIGKILL, SIGTERM, SIGSTOP to the worker's process (a crash, a
  preemption notice, a frozen worker);
* ``heal``, ``cut``: the worker's SSH host cut off from the master for 20 s, or for good;
* ``loss``: 1 % of the packets between the SSH hosts and the master lost (and 1 % duplicated);
* ``restart``: the platform's API (dockerd, the Kubernetes API server) away for 10 s.

Fiber runs on each backend of ``--backends`` (``local``, ``docker``, ``ssh``, ``kubernetes``:
the test services of ``scripts/test-services.sh``, configured as their plugins' tests do,
``scoring.backends``); the peers run on this machine.

Where the worker processes are: the pool's worker table for Fiber's local backend, the run's
worker processes found in ``/proc`` for its other backends (containers, pods and the SSH
hosts' namespaces all share this machine's process table), ``pool._pool`` for
``multiprocessing.Pool``, the executor's process table for ``concurrent.futures`` and loky,
psutil's children of the program for Dask (``LocalCluster``, processes) and Ray
(``ray.util.multiprocessing.Pool``).

Each cell runs in a process of its own with a hard time limit: one that takes no result for
``--stall`` seconds once its pool is up (longer than Fiber's default ``heartbeat_timeout``,
15 s, twice over), whose pool is not up within ``--start`` seconds, or that runs past
``--limit``, is ``hung``. A cell is ``exact`` (every result, each once, right),
``wrong`` (a result that is not the task's), ``lost`` (results missing), ``hung``, or
``raised`` (the exception that reached the program), with its time against the same
library's undisturbed run. Peers that are not installed are left out: install them in a
virtual environment of their own, never in the project's::

    python3 -m venv /tmp/peers && /tmp/peers/bin/pip install -e . loky 'dask[distributed]' \\
        'ray[default]' psutil
    /tmp/peers/bin/python benchmarks/scorecard.py                  # the default size
    /tmp/peers/bin/python benchmarks/scorecard.py --tasks 100000  # the full size
    python benchmarks/scorecard.py --tasks 200 --libraries fiber --kinds none,kill
    .venv/bin/python benchmarks/scorecard.py --libraries fiber --backends local,docker,ssh,kubernetes

``FIBER_CHAOS_SEED=N`` (or ``--seed N``) replays the schedules of a printed run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from scoring import backends as fiber_backends  # noqa: E402
from scoring.kinds import BACKENDS, DESCRIPTIONS, KINDS, fault_count, not_applicable  # noqa: E402
from scoring.strike import Network, Striker, load_chaos  # noqa: E402

from fiber_core.testing.faults import FaultSchedule, chaos_seed  # noqa: E402

LIBRARIES = ("fiber", "multiprocessing", "futures", "loky", "dask", "ray")
"""Every library the scorecard knows, in the order of its table."""

REQUIRES = {"loky": "loky", "dask": "distributed", "ray": "ray"}
"""The module each peer needs (the others come with Python or with Fiber)."""

BACKEND_REQUIRES = {"docker": "fiber_docker", "ssh": "fiber_ssh", "kubernetes": "fiber_k8s"}
"""The plugin each of Fiber's backends needs (``local`` is the core's)."""

RESULT_MARK = "SCORECARD-RESULT "
PROGRESS_MARK = "SCORECARD-PROGRESS "
PROGRESS_SECONDS = 0.5
"""How often a cell's process says how many results it has taken."""

MODULUS = 1_000_003

CLOSE_SECONDS = 60.0
"""How long a cell waits for its pool to close (containers and pods are removed then)."""


# ---------------------------------------------------------------------------------------
# The workload (pure: what each task returns, and what every result should be)

def spin(seconds: float) -> None:
    """Burn ``seconds`` of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def map_task(x: int) -> int:
    spin(0.001 + (x % 5) * 0.001)  # 1-5 ms of CPU
    return map_value(x)


def es_task(arg: tuple[int, int]) -> int:
    theta, i = arg
    spin(0.001)
    return es_value(theta, i)


def map_value(x: int) -> int:
    return x * x % MODULUS


def es_value(theta: int, i: int) -> int:
    return (theta * 31 + i * 17) % MODULUS


def es_next(theta: int, results: list[int]) -> int:
    """The next generation's argument: depends on every result of this one."""
    return (theta + sum(results)) % MODULUS


def run_chunk(func: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """A chunk of tasks as one, for a library without a chunk size (Dask)."""
    return [func(x) for x in items]


@dataclass(frozen=True)
class Workload:
    tasks: int
    generations: int
    population: int
    chunksize: int

    @property
    def results(self) -> int:
        """How many results the whole run takes: the points a schedule is drawn among."""
        return self.tasks + self.generations * self.population


def judge(got: list[Any], expected: list[Any]) -> str:
    """``exact``, ``lost N`` (results missing) or ``wrong N`` (results not the task's); an
    exception handed back as a result is counted and named."""
    wrong = sum(1 for g, e in zip(got, expected) if g != e)
    errors = [g for g in got if isinstance(g, BaseException)]
    if errors:
        return (f"lost {len(expected) - len(got) + len(errors)} ({len(errors)} "
                f"{type(errors[0]).__name__} returned as results)")
    if len(got) < len(expected):
        return f"lost {len(expected) - len(got)}"
    if wrong or len(got) > len(expected):
        return f"wrong {wrong + len(got) - len(expected)}"
    return "exact"


# ---------------------------------------------------------------------------------------
# The libraries: each starts its pool, runs a map in order, lists its workers, closes

class Progress:
    """The count of results the program has taken, where ``tests/chaos.py`` reads a pool's."""

    def __init__(self) -> None:
        self._tasks_done = 0


class Library:
    """One library's pool of ``workers`` processes."""

    def map(self, func: Callable[[Any], Any], items: list[Any], chunksize: int,
            progress: Progress) -> list[Any]:
        out = []
        for result in self.ordered(func, items, chunksize):
            out.append(result)
            progress._tasks_done += 1
        return out

    def ordered(self, func: Callable[[Any], Any], items: list[Any], chunksize: int) -> Iterator[Any]:
        raise NotImplementedError

    def pids(self) -> list[int]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def by_start(pids: Iterable[int]) -> list[int]:
    """Processes in the order they started (a stable worker index), those still there."""
    import psutil  # only where a library's workers are found by psutil

    found = []
    for pid in pids:
        try:
            found.append((psutil.Process(pid).create_time(), pid))
        except psutil.Error:
            pass
    return [pid for _, pid in sorted(found)]


def children(keep: Callable[[str], bool]) -> list[int]:
    """This program's descendant processes whose command line ``keep`` accepts."""
    import psutil  # only where a library's workers are found by psutil

    pids = []
    for child in psutil.Process().children(recursive=True):
        try:
            if keep(" ".join(child.cmdline())):
                pids.append(child.pid)
        except psutil.Error:
            pass
    return by_start(pids)


class FiberPool(Library):
    def __init__(self, workers: int, backend: str = "local") -> None:
        import fiber_core
        from fiber_core.runtime.run import runtime

        self.pool = fiber_core.Pool(workers)
        self.run_id = runtime().run_id
        if backend == "local":  # the pool's own table (the workers' processes are its children)
            self._serving = load_chaos().serving(self.pool)
        else:  # a job's id is a container, a pod, a host's job: its process is found by the run
            self._serving = lambda: fiber_backends.run_workers(self.run_id)

    def ordered(self, func: Callable[[Any], Any], items: list[Any], chunksize: int) -> Iterator[Any]:
        return self.pool.imap(func, items, chunksize)

    def pids(self) -> list[int]:
        return self._serving()

    def close(self) -> None:
        self.pool.terminate()


class StdlibPool(Library):
    def __init__(self, workers: int) -> None:
        import multiprocessing

        self.pool = multiprocessing.Pool(workers)

    def ordered(self, func: Callable[[Any], Any], items: list[Any], chunksize: int) -> Iterator[Any]:
        return self.pool.imap(func, items, chunksize)

    def pids(self) -> list[int]:
        return [p.pid for p in self.pool._pool if p.pid is not None]  # type: ignore[attr-defined]

    def close(self) -> None:
        self.pool.terminate()


class Executor(Library):
    """``concurrent.futures.ProcessPoolExecutor`` or loky's reusable executor."""

    def __init__(self, workers: int, loky: bool = False) -> None:
        if loky:
            import loky as loky_module

            self.executor: Any = loky_module.ProcessPoolExecutor(workers)
        else:
            from concurrent.futures import ProcessPoolExecutor

            self.executor = ProcessPoolExecutor(workers)
        self.executor.submit(int).result()  # its workers are up, as a Pool's are

    def ordered(self, func: Callable[[Any], Any], items: list[Any], chunksize: int) -> Iterator[Any]:
        return self.executor.map(func, items, chunksize=chunksize)

    def pids(self) -> list[int]:
        return sorted(dict(self.executor._processes or {}))

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class DaskPool(Library):
    def __init__(self, workers: int) -> None:
        from distributed import Client, LocalCluster

        self.cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                    host="127.0.0.1", dashboard_address=None)
        self.client = Client(self.cluster)

    def map(self, func: Callable[[Any], Any], items: list[Any], chunksize: int,
            progress: Progress) -> list[Any]:
        from distributed import as_completed

        chunks = [items[i:i + chunksize] for i in range(0, len(items), chunksize)]
        futures = self.client.map(run_chunk, [func] * len(chunks), chunks, pure=False)
        place = {f.key: i for i, f in enumerate(futures)}
        done: dict[int, list[Any]] = {}
        for future, result in as_completed(futures, with_results=True):
            done[place[future.key]] = result
            progress._tasks_done += len(result)
        return [r for i in sorted(done) for r in done[i]]

    def pids(self) -> list[int]:
        return children(lambda cmd: "resource_tracker" not in cmd)

    def close(self) -> None:
        self.client.close(timeout=10)
        self.cluster.close(timeout=10)


class RayPool(Library):
    def __init__(self, workers: int) -> None:
        # Ray binds to the host's interface address unless told it is not a cluster: loopback only
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        import ray
        from ray.util.multiprocessing import Pool

        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False,
                 configure_logging=False, _node_ip_address="127.0.0.1")  # loopback only
        self.pool = Pool(workers)

    def ordered(self, func: Callable[[Any], Any], items: list[Any], chunksize: int) -> Iterator[Any]:
        return self.pool.imap(func, items, chunksize)

    def pids(self) -> list[int]:
        return children(lambda cmd: cmd.startswith("ray::") and "IDLE" not in cmd)

    def close(self) -> None:
        import ray

        self.pool.terminate()
        ray.shutdown()


def start(library: str, workers: int, backend: str = "local") -> Library:
    if library == "fiber":
        return FiberPool(workers, backend)
    if library == "multiprocessing":
        return StdlibPool(workers)
    if library in ("futures", "loky"):
        return Executor(workers, loky=library == "loky")
    if library == "dask":
        return DaskPool(workers)
    if library == "ray":
        return RayPool(workers)
    raise ValueError(f"unknown library {library!r} (known: {', '.join(LIBRARIES)})")


# ---------------------------------------------------------------------------------------
# One cell, in a process of its own

def schedule_for(kind: str, seed: int, workload: Workload, faults: int) -> FaultSchedule:
    """The schedule of one fault kind: ``faults`` faults among the run's results, after the
    first tenth (every library's workers are all up by then)."""
    count = fault_count(kind, faults)
    return FaultSchedule.spread(seed, workload.results, count, kinds=(kind if count else "kill",),
                                first=workload.results // 10)


def run_workload(lib: Library, workload: Workload, progress: Progress) -> str:
    """The map and the ES loop; the verdict on every result."""
    expected = [map_value(x) for x in range(workload.tasks)]
    verdict = judge(lib.map(map_task, list(range(workload.tasks)), workload.chunksize, progress), expected)
    if verdict != "exact":
        return verdict
    theta = 1
    for _ in range(workload.generations):
        args = [(theta, i) for i in range(workload.population)]
        results = lib.map(es_task, args, workload.chunksize, progress)
        verdict = judge(results, [es_value(theta, i) for i in range(workload.population)])
        if verdict != "exact":
            return verdict
        theta = es_next(theta, results)
    return "exact"


def report_progress(progress: Progress, stop: threading.Event) -> None:
    while not stop.wait(PROGRESS_SECONDS):
        print(f"{PROGRESS_MARK}{progress._tasks_done}", flush=True)


def cell(args: argparse.Namespace) -> None:
    """Runs one library (on one backend, for Fiber) under one kind's schedule and prints its
    result line."""
    backend = args.backend if args.library == "fiber" else "local"
    with fiber_backends.configured(backend, api_outage=args.kind == "restart") as api:
        strike_cell(args, backend, api)


def strike_cell(args: argparse.Namespace, backend: str, api: Any) -> None:
    workload = Workload(args.tasks, args.generations, args.population, args.chunksize)
    schedule = schedule_for(args.kind, args.kind_seed, workload, args.faults)
    lib = start(args.library, args.workers, backend)
    lib.map(abs, list(range(4 * args.workers)), 1, Progress())  # every library's workers up, then the clock
    network = Network() if isinstance(lib, FiberPool) and backend == "ssh" else None
    progress = Progress()
    stop = threading.Event()
    threading.Thread(target=report_progress, args=(progress, stop), daemon=True).start()
    striker = Striker(progress, schedule, lib.pids, network=network, api=api)
    began = time.perf_counter()
    with striker:
        try:
            outcome = run_workload(lib, workload, progress)
        except BaseException as e:  # what reached the program is the result
            outcome = f"raised {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        elapsed = time.perf_counter() - began
    stop.set()
    result = {"outcome": outcome, "seconds": elapsed, "struck": striker.struck}
    if isinstance(lib, FiberPool):  # the workers it counted lost, by end reason
        result["losses"] = lib.pool.status_snapshot()["losses"]
    print(RESULT_MARK + json.dumps(result), flush=True)
    for _, kind, pid in striker.struck:  # let a frozen worker end with its pool
        if kind == "stop" and isinstance(pid, int):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    closing = threading.Thread(target=lib.close, daemon=True)
    closing.start()
    closing.join(CLOSE_SECONDS)
    if closing.is_alive():
        os._exit(0)  # a pool that cannot close: its result is out, the table's watcher ends the rest


# ---------------------------------------------------------------------------------------
# The table: each cell in a child process, watched for progress

def end_all(proc: subprocess.Popen[bytes]) -> None:
    """Ends a cell's process, its process group and every descendant it still has."""
    pids = []
    try:
        import psutil

        pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    except Exception:
        pass  # gone already, or no psutil: the process group below
    for pid in [proc.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def read_marks(path: str) -> tuple[int | None, dict[str, Any] | None]:
    """The last progress count (None before the cell's pool is up) and the result line a
    cell's output holds so far."""
    done, result = None, None
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith(PROGRESS_MARK):
                done = int(line[len(PROGRESS_MARK):])
            elif line.startswith(RESULT_MARK):
                result = json.loads(line[len(RESULT_MARK):])
    return done, result


def hung_why(running: float, quiet: float | None, stall: float, start: float, limit: float) -> str | None:
    """Why a cell that has run ``running`` seconds, the last ``quiet`` of them without a new
    result (None: its pool is not up yet), counts as hung; None while it does not. A pool's
    start is bounded by ``start``, not ``stall``: on a loaded machine a cluster's start may
    take longer than a stall, and it is not a fault's doing."""
    if running > limit:
        return f"past {limit:g} s"
    if quiet is None:
        return f"not started within {start:g} s" if running > start else None
    return f"no result for {stall:g} s" if quiet > stall else None


def watch(proc: subprocess.Popen[bytes], out: str, args: argparse.Namespace) -> dict[str, Any]:
    """Waits for a cell's result; ``hung`` as :func:`hung_why` says."""
    began = time.monotonic()
    last_move: float | None = None
    seen = None
    while True:
        time.sleep(0.2)
        done, result = read_marks(out)
        now = time.monotonic()
        if result is not None:
            try:
                proc.wait(30)  # it closes its pool, then exits
            except subprocess.TimeoutExpired:
                pass
            end_all(proc)
            return result
        if proc.poll() is not None:
            end_all(proc)
            with open(out, errors="replace") as f:
                tail = f.read()[-400:].strip().replace("\n", " | ")
            return {"outcome": f"raised (the process exited {proc.returncode}: {tail})", "seconds": now - began}
        if done is not None and done != seen:
            seen, last_move = done, now
        why = hung_why(now - began, None if last_move is None else now - last_move, args.stall, args.start,
                       args.limit)
        if why:
            end_all(proc)
            return {"outcome": f"hung ({why}, at result {done or 0})", "seconds": now - began}


def run_cell(args: argparse.Namespace, row: Row, kind: str, seed: int) -> dict[str, Any]:
    command = [sys.executable, os.path.abspath(__file__), "--cell", row.library, kind, "--kind-seed", str(seed),
               "--backend", row.backend, "--tasks", str(args.tasks), "--generations", str(args.generations),
               "--population", str(args.population), "--chunksize", str(args.chunksize),
               "--workers", str(args.workers), "--faults", str(args.faults)]
    with tempfile.NamedTemporaryFile(prefix="scorecard-", suffix=".log", delete=False) as f:
        out = f.name
    try:
        with open(out, "wb") as sink:
            proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        return watch(proc, out, args)
    finally:
        os.unlink(out)


@dataclass(frozen=True)
class Row:
    """One row of the table: a library, and for Fiber the backend its workers run on."""

    library: str
    backend: str = "local"

    @property
    def label(self) -> str:
        return f"fiber {self.backend}" if self.library == "fiber" else self.library

    def missing(self) -> str | None:
        """What is not installed for this row, or None."""
        module = REQUIRES.get(self.library) or (BACKEND_REQUIRES.get(self.backend) if self.library == "fiber" else None)
        if module is None or importlib.util.find_spec(module) is not None:
            return None
        return module


def rows_of(libraries: list[str], backends: list[str]) -> list[Row]:
    """The table's rows: Fiber once per backend, each peer once (on this machine)."""
    return [Row(library, backend) for library in libraries
            for backend in (backends if library == "fiber" else ["local"])]


def describe(result: dict[str, Any], reference: float | None) -> str:
    """One cell of the table: the outcome, and the time against the undisturbed run."""
    outcome = result["outcome"]
    if outcome == "exact" and reference:
        return f"exact, {result['seconds'] / reference:.2f}x ({result['seconds']:.1f} s)"
    if outcome.startswith("raised"):
        return outcome.split(":", 1)[0]  # the exception's name; its message is in the log above
    return outcome


def check_names(libraries: list[str], backends: list[str], kinds: list[str]) -> None:
    for name, known, what in ([(n, LIBRARIES, "library") for n in libraries]
                              + [(n, BACKENDS, "backend") for n in backends]
                              + [(n, KINDS, "fault kind") for n in kinds]):
        if name not in known:
            sys.exit(f"unknown {what} {name!r} (libraries: {', '.join(LIBRARIES)}; "
                     f"backends: {', '.join(BACKENDS)}; kinds: {', '.join(KINDS)})")


def table(args: argparse.Namespace) -> None:
    libraries = [name for name in args.libraries.split(",") if name]
    backends = [name for name in args.backends.split(",") if name]
    kinds = [k for k in args.kinds.split(",") if k]
    check_names(libraries, backends, kinds)
    seed = chaos_seed(args.seed)
    seeds = {kind: seed + i for i, kind in enumerate(KINDS)}
    workload = Workload(args.tasks, args.generations, args.population, args.chunksize)
    print(f"{args.workers} workers; a map of {args.tasks} tasks of 1-5 ms CPU, then {args.generations} "
          f"generations of {args.population} tasks of 1 ms; chunk size {args.chunksize}; "
          f"hung: no result for {args.stall:g} s once started, not started within {args.start:g} s, "
          f"or past {args.limit:g} s\n")
    for kind in kinds:
        print(f"{kind}: {DESCRIPTIONS[kind]}")
        if kind != "none":
            faults = schedule_for(kind, seeds[kind], workload, args.faults).faults
            points = ", ".join(f"after {f.after} on worker index {f.worker}" for f in faults)
            print(f"{kind}: seed {seeds[kind]}: {points}")
    print(flush=True)
    notes: dict[str, int] = {}
    lines = []
    for row in rows_of(libraries, backends):
        if row.missing():
            print(f"{row.label}: {row.missing()} is not installed, left out", flush=True)
            continue
        results: dict[str, dict[str, Any]] = {}
        for kind in kinds:
            why = not_applicable(row.library, row.backend, kind)
            if why is not None:
                results[kind] = {"outcome": f"n/a [{notes.setdefault(why, len(notes) + 1)}]"}
                continue
            results[kind] = run_cell(args, row, kind, seeds[kind])
            print(f"{row.label} {kind}: {json.dumps(results[kind])}", flush=True)
        none = results.get("none", {})
        reference = none.get("seconds") if none.get("outcome") == "exact" else None
        lines.append(f"| {row.label} | {' | '.join(describe(results[k], reference) for k in kinds)} |")
    print(f"\n| library | {' | '.join(kinds)} |")
    print(f"|---|{'---|' * len(kinds)}")
    print("\n".join(lines))
    for why, number in notes.items():
        print(f"\n[{number}] n/a: {why}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--libraries", default=",".join(LIBRARIES), help="comma-separated, of " + ", ".join(LIBRARIES))
    ap.add_argument("--backends", default="local",
                    help="Fiber's backends, comma-separated, of " + ", ".join(BACKENDS) + " (a row each)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, of " + ", ".join(KINDS))
    ap.add_argument("--tasks", type=int, default=5000, help="tasks of the map (the issue's size: 100000)")
    ap.add_argument("--generations", type=int, default=5)
    ap.add_argument("--population", type=int, default=400)
    ap.add_argument("--chunksize", type=int, default=10)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--faults", type=int, default=3, help="faults per schedule")
    ap.add_argument("--seed", type=int, default=29, help="the first schedule's seed (FIBER_CHAOS_SEED wins)")
    ap.add_argument("--stall", type=float, default=40.0, help="seconds without a result that count as hung")
    ap.add_argument("--limit", type=float, default=300.0, help="seconds a cell may run in all")
    ap.add_argument("--start", type=float, default=300.0,
                    help="seconds a cell's pool may take to start (a stall counts from then)")
    ap.add_argument("--cell", nargs=2, metavar=("LIBRARY", "KIND"), help=argparse.SUPPRESS)
    ap.add_argument("--kind-seed", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--backend", default="local", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name in ("tasks", "generations", "population", "chunksize", "workers"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    if args.cell:
        args.library, args.kind = args.cell
        cell(args)
    else:
        table(args)


if __name__ == "__main__":
    main()
