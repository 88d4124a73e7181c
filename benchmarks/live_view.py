"""What watching a run costs it: a pool's map with its status page served and polled every second, and without.

One pool of ``--workers`` workers maps ``--tasks`` no-op tasks at ``chunksize=1``,
``--rounds`` times with the view on and as many without, interleaved (on, off, off, on,
...), and the medians of the tasks per second are compared. "On" is the program's status
page served (``fiber_core.serve_status(page=True)``) and a client in another process
asking it for ``status.json`` every second, as the page's script does, for the whole
map; "off" is the same pool with nobody asking. (The history the pool keeps for the
view, sampled once a second, is kept in both: it is not switched off.)

The workers are simulated by default (``--simulators`` processes speak the real protocol
for all of them, as in ``benchmarks/master.py``), so that 512 workers fit a small
machine; ``--real`` starts real local workers instead.

    python benchmarks/live_view.py --workers 512 --tasks 1000000 --rounds 3
    python benchmarks/live_view.py --real --workers 64 --tasks 200000
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

# A client as the page's script is: one GET of status.json a second, in a process of its own.
CLIENT = """
import json, sys, time, urllib.request
url, token = sys.argv[1], sys.argv[2]
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
sizes = []
while True:
    started = time.monotonic()
    request = urllib.request.Request(url, headers={"X-Fiber-Token": token})
    with opener.open(request, timeout=30) as response:
        sizes.append(len(response.read()))
    print(json.dumps([len(sizes), max(sizes)]), flush=True)
    time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))  # the page's own rate
"""


def noop(x: Any) -> Any:
    return x


def _ready(pool: Any, n: int) -> None:
    deadline = time.monotonic() + 600
    while sum(w.ready for w in list(pool._workers.values())) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"{n} workers were not ready within 600 s")
        time.sleep(0.05)


def one_map(pool: Any, tasks: int, url: str | None) -> dict[str, float]:
    """Tasks per second of one map, with a client polling ``url`` meanwhile (if given)."""
    client = None
    if url is not None:
        base, token = url.split("/?token=")
        client = subprocess.Popen([sys.executable, "-c", CLIENT, base + "/status.json", token],
                                  stdout=subprocess.PIPE, text=True)
        assert client.stdout is not None
        client.stdout.readline()  # its first answer came: the view is being watched
    clock = time.pthread_getcpuclockid(pool._thread.ident)
    try:
        m0, p0, t0 = time.clock_gettime(clock), time.process_time(), time.perf_counter()
        out = pool.map(noop, range(tasks), chunksize=1)
        elapsed = time.perf_counter() - t0
        master_cpu, process_cpu = time.clock_gettime(clock) - m0, time.process_time() - p0
        assert len(out) == tasks and out[-1] == tasks - 1
    finally:
        polls, biggest = 0, 0
        if client is not None:
            client.terminate()
            rest, _ = client.communicate(timeout=30)
            lines = rest.splitlines()
            if lines:
                polls, biggest = json.loads(lines[-1])
    return {"rate": tasks / elapsed, "polls": polls, "json_bytes": biggest,
            "master_us": master_cpu / tasks * 1e6, "process_us": process_cpu / tasks * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=512)
    ap.add_argument("--tasks", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=3, help="maps with the view on, and as many off")
    ap.add_argument("--real", action="store_true", help="real local workers, not simulated ones")
    ap.add_argument("--simulators", type=int, default=2)
    args = ap.parse_args()

    backend = None
    if not args.real:
        import master as sim  # benchmarks/master.py: its simulated workers

        ctx = multiprocessing.get_context("fork")  # before this process starts any thread
        controls = []
        for _ in range(args.simulators):
            ours, theirs = ctx.Pipe()
            ctx.Process(target=sim.simulate, args=(theirs, 0.0), daemon=True).start()
            theirs.close()
            controls.append(ours)
        from fiber_core import hookimpl
        from fiber_core.runtime.config import plugins

        sim_backend = sim.make_backend(controls)

        class Plugin:
            @hookimpl
            def fiber_register_backends(self, register: Any) -> None:
                register(sim_backend)

        plugins().register_plugin(Plugin(), name="sim")
        backend = "sim"

    import fiber_core

    url = fiber_core.serve_status(page=True).url
    assert url is not None
    pool = fiber_core.Pool(args.workers, backend=backend)
    runs: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    try:
        _ready(pool, args.workers)
        pool.map(noop, range(args.workers * 4), chunksize=1)  # warm: every worker has the function
        order = ["on", "off", "off", "on"] * ((args.rounds + 1) // 2)
        for view in order[:2 * args.rounds]:
            r = one_map(pool, args.tasks, url if view == "on" else None)
            runs[view].append(r)
            print(f"view {view:3}  {r['rate']:>10,.0f} tasks/s  master {r['master_us']:.2f} us/task  "
                  f"process {r['process_us']:.2f} us/task"
                  + (f"  ({r['polls']:.0f} polls, status.json up to {r['json_bytes'] / 1024:,.0f} KiB)"
                     if view == "on" else ""), flush=True)
    finally:
        pool.terminate()
        pool.join()
    on = statistics.median(r["rate"] for r in runs["on"])
    off = statistics.median(r["rate"] for r in runs["off"])
    kind = "real" if args.real else f"simulated ({args.simulators} processes)"
    print(f"{args.workers} {kind} workers, {args.tasks:,} no-op tasks at chunksize=1, "
          f"medians of {args.rounds}: view on {on:,.0f} tasks/s, off {off:,.0f} tasks/s "
          f"({100 * (on - off) / off:+.1f} %)")
    for what in ("master_us", "process_us"):
        on, off = (statistics.median(r[what] for r in runs[v]) for v in ("on", "off"))
        print(f"  {what[:-3]} CPU per task: view on {on:.2f} us, off {off:.2f} us ({100 * (on - off) / off:+.1f} %)")


if __name__ == "__main__":
    main()
