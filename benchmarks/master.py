"""The Pool master's CPU per task, from 64 to 4,096 workers, driven by simulated workers.

More workers than this machine can run as interpreters are *simulated*: a few processes
each hold many workers' connections and speak the real protocol to the real parent.
Each simulated job is started by a backend of this script (``sim``) through the real
``Process``/``Pool`` machinery: it dials the parent's hub with the run's key as a job
does, receives its process object, dials the pool, says it is ready, and answers every
batch of tasks by running the task function (``noop``) and sending the real results
message, after ``--task-ms`` per task of waiting that costs no CPU (a timer). Like a real
worker, each sends ``POOL_HEARTBEAT`` at the interval its process object names.

For each pool size: the CPU time of the pool's master thread (its own thread clock)
and of the whole parent process during ``map``, divided by the number of tasks, and
the tasks per second. Sizes run in the same program, one after another, each with a
fresh pool (``--rounds`` times, medians).

    python benchmarks/master.py --sizes 64,256,1024,4096 --per-worker 100 --task-ms 10
    python benchmarks/master.py --sizes 64,1024 --chunksize 1 --task-ms 0 --tasks 200000
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import multiprocessing
import os
import selectors
import socket
import statistics
import sys
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def noop(x: Any) -> Any:
    return x


# -- the simulator -------------------------------------------------------------------------


def simulate(control: Any, task_ms: float) -> None:  # noqa: C901 - its closures share one event loop's state; the benchmark's, not the library's
    """Hold simulated workers: start the ones ``control`` names, answer their batches."""
    # Orders are read by a thread of their own: a start waits for the parent's first
    # frames, which it sends only once the whole group is created, and the orders of the
    # rest of the group must not fill the pipe meanwhile.
    import queue

    from fiber_core.contract.env import ENV_AUTHKEY, ENV_HUB, job_token
    from fiber_core.parallel.pool.worker import encode_results, load_func, run_unit
    from fiber_core.runtime.hub import dial
    from fiber_core.wire.framing import Connection
    from fiber_core.wire.messages import (
        POOL_QUIT,
        POOL_READY,
        POOL_RESULTS,
        POOL_TASKS,
        decode_pool_tasks,
        decode_process_object,
        encode_pool_heartbeat,
        encode_pool_hello,
        kind_of,
    )

    orders: queue.SimpleQueue = queue.SimpleQueue()
    wake_r, wake_w = socket.socketpair()

    wake_w.setblocking(False)

    def wake() -> None:
        try:
            wake_w.send(b"\0")
        except BlockingIOError:
            pass  # a wake-up is pending: the loop reads every order then

    def read_orders() -> None:
        while True:
            try:
                orders.put(control.recv())
            except EOFError:
                orders.put(None)
                wake()
                return
            wake()

    threading.Thread(target=read_orders, daemon=True).start()
    sel = selectors.DefaultSelector()
    sel.register(wake_r, selectors.EVENT_READ, None)
    jobs: dict[str, tuple[Connection, Connection]] = {}
    funcs: dict[int, Any] = {}
    due: list[tuple[float, int, Connection, bytes]] = []
    sequence = itertools.count()
    busy: dict[str, float] = {}  # when each worker's last batch is done
    beat = {"every": 0.0, "next": float("inf")}  # every worker's heartbeat, as a real one sends it

    def start(job_id: str, env: dict[str, str]) -> None:
        key = bytes.fromhex(env[ENV_AUTHKEY])
        proc_conn = Connection(dial(env[ENV_HUB], key, f"proc:{job_token(env)}"))
        proc_conn.recv_bytes()  # the prelude
        proc = decode_process_object(proc_conn.recv_bytes())
        hub, pool_id, wid = proc._args[:3]
        if len(proc._args) > 6 and proc._args[6] > 0:  # its heartbeat interval
            beat["every"] = proc._args[6]
            beat["next"] = min(beat["next"], time.monotonic() + beat["every"])
        pool_conn = Connection(dial(hub, key, f"pool:{pool_id}"))
        pool_conn.send_frame(encode_pool_hello(wid))
        pool_conn.send_frame(POOL_READY)
        jobs[job_id] = (proc_conn, pool_conn)
        sel.register(pool_conn.fileno(), selectors.EVENT_READ, (job_id, pool_conn))

    def stop(job_id: str) -> None:
        conns = jobs.pop(job_id, None)
        if conns is not None:
            try:
                sel.unregister(conns[1].fileno())
            except (KeyError, ValueError):
                pass
            for c in conns:
                c.close()

    while True:
        timeout = None if not due else max(0.0, due[0][0] - time.monotonic())
        if beat["every"]:
            left = max(0.0, beat["next"] - time.monotonic())
            timeout = left if timeout is None else min(timeout, left)
        for key, _ in sel.select(timeout):
            if key.data is None:
                wake_r.recv(4096)
                while not orders.empty():
                    order = orders.get()
                    if order is None:
                        return
                    what, job_id, env = order
                    if what == "start":
                        try:
                            start(job_id, env)
                        except (OSError, EOFError):
                            stop(job_id)
                    else:
                        stop(job_id)
                continue
            job_id, conn = key.data
            try:
                msg = conn.recv_bytes()
            except (EOFError, OSError):
                stop(job_id)
                continue
            op = kind_of(msg)
            if op == POOL_QUIT:
                stop(job_id)
            elif op == POOL_TASKS:
                batch_id, call_id, func_bytes, kind, units = decode_pool_tasks(msg)[:5]
                if func_bytes is not None:
                    funcs[call_id] = load_func(func_bytes)
                results = [run_unit(funcs[call_id], kind, unit, None) for unit in units]
                # a unit of a map is a chunk: a list of its items' results
                items = sum(len(v) if ok and isinstance(v, list) else 1 for ok, v in results)
                seconds = task_ms / 1000 * items
                payload = encode_results(batch_id, seconds, results)
                if task_ms > 0:  # a worker runs its batches one after another
                    at = busy[job_id] = max(time.monotonic(), busy.get(job_id, 0.0)) + seconds
                    heapq.heappush(due, (at, next(sequence), conn, payload))
                else:
                    try:
                        conn.send_frame(POOL_RESULTS, payload)
                    except OSError:
                        stop(job_id)
        now = time.monotonic()
        if beat["every"] and now >= beat["next"]:
            frame = encode_pool_heartbeat(0.0, 1 << 25, None, None)
            for _, pool_conn in list(jobs.values()):
                try:
                    pool_conn.send_frame(frame)
                except OSError:
                    pass
            beat["next"] = now + beat["every"]
        while due and due[0][0] <= now:
            _, _, conn, payload = heapq.heappop(due)
            try:
                conn.send_frame(POOL_RESULTS, payload)
            except OSError:
                pass


# -- the parent ------------------------------------------------------------------------------


def make_backend(controls: list[Any]) -> type:
    from fiber_core.contract import Backend, EndReason, Job, JobSpec

    class SimBackend(Backend):
        """Jobs that are simulated workers in the simulator processes."""

        name = "sim"
        create_concurrency = 1

        _ids = itertools.count()
        _lock = threading.Lock()

        def create_job(self, spec: JobSpec) -> Job:
            n = next(self._ids)
            job = Job(id=f"sim-{n}", spec=spec, host=f"sim{n % len(controls)}")
            with self._lock:
                controls[n % len(controls)].send(("start", job.id, dict(spec.env)))
            return job

        def _stop(self, job: Job, code: int) -> None:
            with self._lock:
                controls[int(job.id.split("-")[1]) % len(controls)].send(("stop", job.id, None))
            job.state.finish(code, EndReason.STOPPED)

        def terminate_job(self, job: Job) -> None:
            self._stop(job, -15)

        def kill_job(self, job: Job) -> None:
            self._stop(job, -9)

    return SimBackend


def measure(size: int, tasks: int, chunksize: int | None) -> dict[str, float]:
    import fiber_core

    pool = fiber_core.Pool(size, backend="sim")
    try:
        deadline = time.monotonic() + 600
        while sum(w.ready for w in list(pool._workers.values())) < size:
            if time.monotonic() > deadline:
                raise SystemExit(f"{size} simulated workers were not ready within 600 s")
            time.sleep(0.05)
        pool.map(noop, range(size * 4), chunksize=1)  # warm: every worker knows the function
        clock = time.pthread_getcpuclockid(pool._thread.ident)  # type: ignore[arg-type]
        m0, p0, t0 = time.clock_gettime(clock), time.process_time(), time.perf_counter()
        out = pool.map(noop, range(tasks), chunksize=chunksize)
        t1, p1, m1 = time.perf_counter(), time.process_time(), time.clock_gettime(clock)
        assert len(out) == tasks and out[-1] == tasks - 1
    finally:
        pool.terminate()
        pool.join()
    return {"master_us": (m1 - m0) / tasks * 1e6, "process_us": (p1 - p0) / tasks * 1e6,
            "rate": tasks / (t1 - t0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64,256,1024,4096")
    ap.add_argument("--tasks", type=int, default=0, help="tasks per map (default: --per-worker x size)")
    ap.add_argument("--per-worker", type=int, default=100, help="tasks per worker per map")
    ap.add_argument("--task-ms", type=float, default=0.0, help="simulated time per task (no CPU)")
    ap.add_argument("--chunksize", type=int, default=None, help="default: the Pool's own choice")
    ap.add_argument("--simulators", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    # The simulators fork before this process starts any thread.
    ctx = multiprocessing.get_context("fork")
    controls, sims = [], []
    for _ in range(args.simulators):
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=simulate, args=(theirs, args.task_ms), daemon=True)
        p.start()
        theirs.close()
        controls.append(ours)
        sims.append(p)

    from fiber_core import hookimpl
    from fiber_core.runtime.config import plugins

    backend = make_backend(controls)

    class Plugin:
        @hookimpl
        def fiber_register_backends(self, register: Any) -> None:
            register(backend)

    plugins().register_plugin(Plugin(), name="sim")
    results: dict[int, list[dict[str, float]]] = {s: [] for s in sizes}
    for _ in range(args.rounds):
        for size in sizes:
            results[size].append(measure(size, args.tasks or args.per_worker * size, args.chunksize))
    chunk = args.chunksize or "default"
    tasks = f"{args.tasks} tasks" if args.tasks else f"{args.per_worker} tasks per worker"
    print(f"{tasks} of {args.task_ms:g} ms per size, chunksize {chunk}, "
          f"{args.simulators} simulator processes, medians of {args.rounds}")
    print(f"{'workers':>8}{'master us/task':>16}{'process us/task':>17}{'tasks/s':>10}")
    for size, runs in results.items():
        print(f"{size:>8}{statistics.median(r['master_us'] for r in runs):>16.2f}"
              f"{statistics.median(r['process_us'] for r in runs):>17.2f}"
              f"{statistics.median(r['rate'] for r in runs):>10.0f}")
    for c in controls:
        c.close()


if __name__ == "__main__":
    main()
