"""The docker backend next to the local one: job start latency and the Fiber paper's overhead.

Both backends are measured in the same run, in alternating repetitions (the order
flips every repetition); every figure is the median over all samples.

1. Start latency, *start -> first instruction*:
   - a bare job: ``backend.start_job()`` of ``python3 -c "print(time.time())"``; the
     clock is read before the call and by the job's first statement (containers share
     this machine's clock);
   - the same bare job whose program imports ``fiber_core`` first, as a Fiber program
     does: the platform's own start of the program's first line;
   - the standard library's networked worker (``STDLIB_WORKER``): a job that takes its key
     the way Fiber's jobs do, connects back, authenticates both ways with
     ``multiprocessing.connection`` and calls the function it receives: what any worker
     must do before its target runs, with the stdlib's own tools only; and the same with
     ``socket``, ``hmac`` and ``pickle`` alone (``LEAN_WORKER``: one challenge, one pickle);
   - a ``fiber_core.Process``: the clock before ``start()`` and at the first line of its
     target, sent home through a ``Queue`` (its travel time is not counted). This adds
     Fiber's worker bootstrap: connect back, authenticate, unpickle. Measured with no
     spare job ready (every spare let go first), and on the spare container the previous
     start left ready (``spare_jobs``: one by default on Docker; none on the local backend).
   Also *start() returns*: how long ``Process.start()`` blocks the caller, and the CPU
   time each job spent before that first line (``time.process_time()``, its interpreter's
   start included), which a loaded machine changes far less than the wall times.
2. The overhead workload of the Fiber paper (Figure 9): ``Pool(5)``; tasks that sleep
   1 s, 100 ms, 10 ms, 1 ms; 5, 50, 500, 5000 of them, so that the ideal time of each
   batch is 1 s; ``pool.map`` is timed on a pool whose workers have all run a task.
   *Pool start*: ``Pool(5)`` until every worker has run a task.

Usage (from the repository root, with the test dockerd up)::

    bash scripts/test-services.sh up docker
    DOCKER_HOST=unix:///tmp/fiber-services/docker/docker.sock FIBER_DOCKER_IMAGE=fiber-test:latest \\
        python plugins/fiber_docker/benchmarks/bench_docker.py [--reps 5] [--quick]

The workers import this file as their main module (the backend mounts the working
directory), so it imports only ``os``, ``sys``, ``time`` and ``fiber_core`` where a job
runs it; the parent's own tools (argument parsing, statistics) are imported under the
main guard. A job's start then costs here what it costs a program that imports
``fiber_core``, the same program as the bare job that imports it, and not what this
script's reporting needs.
"""

from __future__ import annotations

import os
import sys
import time

import fiber_core

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

if __name__ == "__main__":  # the parent's own tools: a job imports this file too, as its main module
    import argparse
    import platform
    import shlex
    import statistics
    from collections import defaultdict

WORKERS = 5
CASES = [(1.0, 5), (0.1, 50), (0.01, 500), (0.001, 5000)]  # (task seconds, batch size)
BACKENDS = ("docker", "local")
TIMEOUT = 600.0


def first_instruction(q: Any) -> None:
    q.put((time.time(), time.process_time()))


def sleep_task(seconds: float) -> None:
    time.sleep(seconds)


def whoami(seconds: float) -> str:
    time.sleep(seconds)
    # One per job: pids repeat across containers, whose host names differ (a job's token
    # leaves its environment once the worker has read it).
    return f"{os.uname().nodename}:{os.getpid()}"


def printed_clocks(b: Any, job: Any, t0: float) -> tuple[float, float]:
    """The wall clock (less ``t0``) and the CPU seconds that a finished job printed last."""
    deadline = time.monotonic() + 10  # its output may reach the backend's log after its exit
    while not (logs := b.get_job_logs(job).strip()) and time.monotonic() < deadline:
        time.sleep(0.01)
    wall, cpu = logs.split()[-2:]
    return float(wall) - t0, float(cpu)


def job_start(backend: str, preamble: str = "") -> tuple[float, float]:
    """Start -> the bare job's first line (or the one after its preamble), and the job's CPU
    seconds up to there (its interpreter's start included)."""
    # Imported here, as bench_ssh.py does: the workers import this file as their main module,
    # and the backend contract (dataclasses, inspect, json) is no part of a program's start.
    from fiber_core.contract.backend import JobSpec
    from fiber_core.runtime.run import runtime

    b = runtime().get_backend(backend)
    python = "python3" if backend == "docker" else sys.executable
    t0 = time.time()
    job = b.start_job(JobSpec(command=[python, "-c", preamble + "import time; print(repr(time.time()), repr(time.process_time()))"],
                              name="bench-start"))
    if b.wait_for_job(job, TIMEOUT) != 0:
        raise RuntimeError(f"bare job failed: {b.get_job_logs(job)}")
    return printed_clocks(b, job, t0)


# Jobs that do only what any worker started on a platform must do before its target runs,
# with nothing but the standard library: take the key from the platform the way Fiber's jobs
# get it (the docker backend's stdin, read by its shell), connect to the parent, authenticate,
# receive a pickled callable, call it. Their first line is the call's result: the floor of a
# networked, authenticated start in the same image, whoever's library makes it.
STDLIB_WORKER = (  # multiprocessing.connection's Client: HMAC challenges both ways
    "import os, time\n"
    "from multiprocessing.connection import Client\n"
    "key = bytes.fromhex(os.environ.pop('BENCH_KEY'))\n"
    "with Client(('127.0.0.1', int(os.environ['BENCH_PORT'])), authkey=key) as c:\n"
    "    target = c.recv()\n"
    "print(repr(target()), repr(time.process_time()))\n"
)
LEAN_WORKER = (  # socket, hmac and pickle alone: answer one challenge, read one pickle
    "import hmac, os, pickle, socket, time\n"
    "key = bytes.fromhex(os.environ.pop('BENCH_KEY'))\n"
    "with socket.create_connection(('127.0.0.1', int(os.environ['BENCH_PORT']))) as s:\n"
    "    f = s.makefile('rb')\n"
    "    s.sendall(hmac.digest(key, f.read(32), 'sha256'))\n"
    "    target = pickle.loads(f.read(int.from_bytes(f.read(4), 'big')))\n"
    "print(repr(target()), repr(time.process_time()))\n"
)


def _serve_connection(key: bytes) -> tuple[Any, int, Any]:
    """A listener for one :data:`STDLIB_WORKER`, its port, and the thread that sends it ``time.time``."""
    import threading
    from multiprocessing.connection import Listener

    listener = Listener(("127.0.0.1", 0), authkey=key)

    def serve() -> None:
        with listener.accept() as conn:  # authenticates the job before anything is sent
            conn.send(time.time)

    return listener, listener.address[1], threading.Thread(target=serve, daemon=True)


def _serve_lean(key: bytes) -> tuple[Any, int, Any]:
    """A listener for one :data:`LEAN_WORKER`, its port, and the thread that sends it ``time.time``."""
    import hmac
    import pickle
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            challenge = os.urandom(32)
            conn.sendall(challenge)
            answer = conn.makefile("rb").read(32)
            if hmac.compare_digest(answer, hmac.digest(key, challenge, "sha256")):
                payload = pickle.dumps(time.time)
                conn.sendall(len(payload).to_bytes(4, "big") + payload)

    return listener, listener.getsockname()[1], threading.Thread(target=serve, daemon=True)


def stdlib_worker_start(backend: str, lean: bool) -> tuple[float, float]:
    """Start -> the first line of :data:`STDLIB_WORKER`'s target (of :data:`LEAN_WORKER`'s with
    ``lean``), and the job's CPU seconds."""
    from fiber_core.contract.backend import JobSpec
    from fiber_core.runtime.run import runtime

    b = runtime().get_backend(backend)
    python = "python3" if backend == "docker" else sys.executable
    key = os.urandom(32)
    listener, port, server = (_serve_lean if lean else _serve_connection)(key)
    with listener:  # closing it ends the server's accept if the job failed
        server.start()
        spec = JobSpec(command=[python, "-c", LEAN_WORKER if lean else STDLIB_WORKER], name="bench-stdlib-worker",
                       env={"BENCH_PORT": str(port), "BENCH_KEY": key.hex()},
                       secret_env=("BENCH_KEY",))
        t0 = time.time()
        job = b.start_job(spec)
        if b.wait_for_job(job, TIMEOUT) != 0:
            raise RuntimeError(f"stdlib worker failed: {b.get_job_logs(job)}")
        server.join(TIMEOUT)
    return printed_clocks(b, job, t0)


def process_start(backend: str, warm: bool) -> tuple[float, float, float]:
    """A Process started on the spare job the previous start left ready (``warm``; on the local
    backend there is none), or with none (every spare let go first). Before it returns, the
    spare started after it is waited for: no start overlaps a measured one."""
    from fiber_core.processes import spares

    if warm:
        spares.settle(TIMEOUT)
    else:
        spares.release(TIMEOUT)
    q = fiber_core.Queue()
    p = fiber_core.Process(target=first_instruction, args=(q,), backend=backend)
    t0 = time.time()
    p.start()
    returned = time.time() - t0
    first, cpu = q.get(timeout=TIMEOUT)
    first -= t0
    p.join(TIMEOUT)
    if p.exitcode != 0:
        raise RuntimeError(f"process exited with {p.exitcode}")
    spares.settle(TIMEOUT)
    return first, returned, cpu


def pool_turn(backend: str, results: dict) -> None:
    t0 = time.perf_counter()
    pool = fiber_core.Pool(WORKERS, backend=backend)
    try:
        seen: set[str] = set()
        while len(seen) < WORKERS:
            if time.perf_counter() - t0 > TIMEOUT:
                raise RuntimeError(f"only {len(seen)} of {WORKERS} workers ran a task in {TIMEOUT:.0f} s")
            seen.update(pool.map(whoami, [0.05] * (2 * WORKERS), 1))
        results[("pool", "start")][backend].append(time.perf_counter() - t0)
        pool.map(sleep_task, [0.0] * (2 * WORKERS))
        for seconds, batch in CASES:
            t = time.perf_counter()
            pool.map_async(sleep_task, [seconds] * batch).get(TIMEOUT)
            results[("sleep", seconds)][backend].append(time.perf_counter() - t)
    finally:
        pool.close()
        pool.join()


def run(reps: int, starts: int, pool: bool = True) -> dict:
    results: dict = defaultdict(lambda: defaultdict(list))
    for backend in BACKENDS:  # warm-up: image check, first container, imports; not measured
        job_start(backend)
        stdlib_worker_start(backend, lean=False)
        stdlib_worker_start(backend, lean=True)
        process_start(backend, warm=False)
    for r in range(reps):
        t = time.perf_counter()
        for backend in BACKENDS if r % 2 == 0 else BACKENDS[::-1]:
            for _ in range(starts):
                for key, preamble in (("job", ""), ("job+import", "import fiber_core; ")):
                    first, cpu = job_start(backend, preamble)
                    results[("start", key)][backend].append(first)
                    results[("cpu", key)][backend].append(cpu)
                for key, lean in (("stdlib worker", False), ("lean worker", True)):
                    first, cpu = stdlib_worker_start(backend, lean)
                    results[("start", key)][backend].append(first)
                    results[("cpu", key)][backend].append(cpu)
                first, returned, cpu = process_start(backend, warm=False)
                results[("cpu", "process")][backend].append(cpu)
                results[("start", "process")][backend].append(first)
                results[("start", "returns")][backend].append(returned)
                first, returned, _ = process_start(backend, warm=True)
                results[("start", "process on a spare")][backend].append(first)
                results[("start", "returns on a spare")][backend].append(returned)
            if pool:
                pool_turn(backend, results)
        print(f"repetition {r + 1}/{reps}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return results


def report(results: dict, reps: int, starts: int, elapsed: float, load: tuple[float, float]) -> None:
    med = statistics.median
    cmd = shlex.join(["python", os.path.relpath(sys.argv[0]), *sys.argv[1:]])
    print(f"Command: `{cmd}`\n")
    print(f"Python {platform.python_version()}, {os.cpu_count()} CPUs; docker image "
          f"`{os.environ.get('FIBER_DOCKER_IMAGE', '-')}`; {reps} interleaved repetitions "
          f"({starts} starts of each kind per repetition and backend); medians; load average "
          f"{load[0]:.2f} at the start, {load[1]:.2f} at the end; {elapsed:.0f} s in all.\n")
    print("### Start latency (ms)\n")
    print("| | docker | local | docker - local | docker range |")
    print("|---|---:|---:|---:|---:|")
    for key, label in (("job", "bare job: `start_job()` -> first instruction"),
                       ("job+import", "bare job importing fiber_core first -> its next instruction"),
                       ("stdlib worker", "the stdlib's networked worker (`STDLIB_WORKER`) -> its target's first line"),
                       ("lean worker", "socket, hmac and pickle alone (`LEAN_WORKER`) -> its target's first line"),
                       ("process", "`Process.start()` -> first instruction of the target, no spare job"),
                       ("process on a spare", "`Process.start()` -> first instruction of the target, on a ready spare"),
                       ("returns", "`Process.start()` returns, no spare job"),
                       ("returns on a spare", "`Process.start()` returns, on a ready spare")):
        d, lo = results[("start", key)]["docker"], results[("start", key)]["local"]
        print(f"| {label} | {med(d) * 1e3:.0f} | {med(lo) * 1e3:.0f} | {(med(d) - med(lo)) * 1e3:.0f} "
              f"| {min(d) * 1e3:.0f}-{max(d) * 1e3:.0f} |")
    job, job_import = med(results[("start", "job")]["docker"]), med(results[("start", "job+import")]["docker"])
    for key, label in (("stdlib worker", "the stdlib's networked worker"), ("lean worker", "the lean worker")):
        floor = med(results[("start", key)]["docker"])
        print(f"\nOn docker, {label} is {floor / job:.2f}x the bare job and "
              f"{floor / job_import:.2f}x the bare job that imports fiber_core.")
    for key, label in (("process on a spare", "on a ready spare"), ("process", "with no spare job")):
        process = med(results[("start", key)]["docker"])
        print(f"\nOn docker, `Process.start()` -> target's first line, {label}, is {process / job:.2f}x "
              f"the bare job and {process / job_import:.2f}x the bare job that imports fiber_core.")
    print("\n### The job's CPU time before that line (ms): its interpreter's start, Fiber's part\n")
    print("| | docker | local | docker range |")
    print("|---|---:|---:|---:|")
    for key, label in (("job", "bare job"), ("job+import", "bare job importing fiber_core first"),
                       ("stdlib worker", "the stdlib's networked worker, to its target's first line"),
                       ("lean worker", "socket, hmac and pickle alone, to the target's first line"),
                       ("process", "`Process.start()`, no spare job: the worker up to the target's first line")):
        d, lo = results[("cpu", key)]["docker"], results[("cpu", key)]["local"]
        print(f"| {label} | {med(d) * 1e3:.1f} | {med(lo) * 1e3:.1f} | {min(d) * 1e3:.1f}-{max(d) * 1e3:.1f} |")
    if not results[("pool", "start")]["docker"]:
        return  # --starts-only
    print(f"\n### Fiber paper overhead workload: Pool({WORKERS}), ideal time 1 s per batch (s)\n")
    print("| task | batch | docker | local | docker / local | docker range | local range |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for seconds, batch in CASES:
        d, lo = results[("sleep", seconds)]["docker"], results[("sleep", seconds)]["local"]
        label = f"{seconds:g} s" if seconds >= 1 else f"{seconds * 1e3:g} ms"
        print(f"| {label} | {batch} | {med(d):.3f} | {med(lo):.3f} | {med(d) / med(lo):.2f} "
              f"| {min(d):.3f}-{max(d):.3f} | {min(lo):.3f}-{max(lo):.3f} |")
    d, lo = results[("pool", "start")]["docker"], results[("pool", "start")]["local"]
    print(f"| Pool({WORKERS}) start, until every worker ran a task | | {med(d):.3f} | {med(lo):.3f} "
          f"| {med(d) / med(lo):.2f} | {min(d):.3f}-{max(d):.3f} | {min(lo):.3f}-{max(lo):.3f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 5; 1 with --quick)")
    parser.add_argument("--starts", type=int, default=5, help="starts of each kind per repetition")
    parser.add_argument("--quick", action="store_true", help="smoke run")
    parser.add_argument("--starts-only", action="store_true", help="only the start latencies, no Pool workload")
    args = parser.parse_args(argv)
    reps = args.reps or (1 if args.quick else 5)
    starts = 2 if args.quick else args.starts
    t, load = time.perf_counter(), os.getloadavg()[0]
    results = run(reps, starts, pool=not args.starts_only)
    report(results, reps, starts, time.perf_counter() - t, (load, os.getloadavg()[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
