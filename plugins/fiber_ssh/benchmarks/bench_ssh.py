"""fiber-ssh against the local backend: job start latency, and the Fiber paper's overhead workload.

Both backends are measured in the same run, in alternating repetitions (the order flips
every repetition), and every figure is the median over the repetitions' samples.

1. Job start. At the backend level, for a job running ``python -c`` whose first
   statement reads the clock: how long ``create_job`` blocks, *start -> first
   instruction* (the parent reads the clock just before ``create_job``; the hosts share
   this machine's clock) and *start -> exit code known*. At the Fiber level:
   ``Process.start()`` to the first line of the target, with no spare job ready and on
   the spare one (``spare_jobs``: one by default on SSH), and ``start()`` + ``join()``
   of a no-op. For SSH also the cost of one bare command on an open connection
   (``exec true``): what the host's login shell alone takes.
2. The overhead workload of the Fiber paper (Figure 9): ``Pool(5)``; tasks that sleep
   1 s, 100 ms, 10 ms, 1 ms, in batches of 5, 50, 500, 5000 (ideal: 1 s each);
   ``pool.map`` with the default chunksize is timed. Each repetition, each backend gets
   a fresh pool, timed to its first result, warmed up (every worker has answered),
   then the four batches run on it.

The SSH side runs on the hosts of ``[ssh] hosts`` (``FIBER_SSH_*``); with nothing
configured, on the test hosts of ``scripts/services/ssh.sh`` (start them with
``bash scripts/test-services.sh up ssh``), 2 slots each, so that the 5 workers spread
over the 3 hosts. A job imports this file as its main module, so where a job runs it,
it imports only ``os``, ``sys`` and ``time``: the parent's own tools are imported under
the main guard, and a start costs what it costs a program, not this script's reporting.
Usage::

    python plugins/fiber_ssh/benchmarks/bench_ssh.py            # about 3 minutes
    python plugins/fiber_ssh/benchmarks/bench_ssh.py --quick    # smoke run
"""

from __future__ import annotations

import os
import sys
import time

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
WAIT = 120.0
BACKENDS = ("local", "ssh")
FIRST_LINE = "import time; t = time.time(); print('t', repr(t), flush=True)"


def configure_test_hosts() -> str:
    """Point FIBER_SSH_* at the test hosts unless hosts are configured; describe them."""
    import shlex  # here too: a program that imports this function has not run the main guard
    from pathlib import Path

    if os.environ.get("FIBER_SSH_HOSTS"):
        return os.environ["FIBER_SSH_HOSTS"]
    services = Path(os.environ.get("FIBER_SERVICES_DIR", "/tmp/fiber-services"))
    env_file = services / "ssh" / "hosts.env"
    if not env_file.exists():
        sys.exit(f"no [ssh] hosts configured and no test hosts ({env_file} is missing): "
                 "run `bash scripts/test-services.sh up ssh` or set FIBER_SSH_HOSTS")
    facts = {}
    for line in env_file.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            facts[key] = shlex.split(value)[0] if value.strip() else ""
    os.environ.update({
        "FIBER_SSH_HOSTS": ", ".join(f"{h}*2" for h in facts["FIBER_SSH_HOSTS"].split()),
        "FIBER_SSH_USER": facts["FIBER_SSH_USER"],
        "FIBER_SSH_KEY": facts["FIBER_SSH_KEY"],
        "FIBER_SSH_KNOWN_HOSTS": facts["FIBER_SSH_KNOWN_HOSTS"],
        "FIBER_SSH_SSH_CONFIG": "",
    })
    os.environ.setdefault("FIBER_SSH_PYTHON", sys.executable)
    return os.environ["FIBER_SSH_HOSTS"]


def noop() -> None:
    pass


def first_line(q: Any) -> None:
    q.put(time.time())


# -- job start -------------------------------------------------------------------------------


def job_start(backend: Any, python: str, results: dict, name: str) -> None:
    from fiber_core.contract.backend import JobSpec

    t0 = time.time()
    job = backend.start_job(JobSpec(command=[python, "-c", FIRST_LINE], name="bench"))
    t1 = time.time()
    code = backend.wait_for_job(job, WAIT)
    t2 = time.time()
    if code != 0:
        raise RuntimeError(f"{name} job failed ({code}): {backend.get_job_logs(job)}")
    started = next(float(line.split()[1]) for line in backend.get_job_logs(job).splitlines()
                   if line.startswith("t "))
    results[("job", "create_job() returns (ms)")][name].append((t1 - t0) * 1e3)
    results[("job", "start -> first instruction (ms)")][name].append((started - t0) * 1e3)
    results[("job", "start -> exit code known (ms)")][name].append((t2 - t0) * 1e3)


PROCESS_COLD = "Process.start() -> target's first line, no spare job (ms)"
PROCESS_WARM = "Process.start() -> target's first line, on a ready spare (ms)"


def process_start(results: dict, name: str) -> None:
    """A Process started with no spare job ready (each spare let go first), then one started on
    the spare the first left ready (none on the local backend: both start cold there). Between
    measurements, the spare being started in the background is waited for, so that no start
    overlaps a measured one."""
    import fiber_core
    from fiber_core.processes import spares

    for label, warm in ((PROCESS_COLD, False), (PROCESS_WARM, True)):
        if warm:
            spares.settle(WAIT)
        else:
            spares.release(WAIT)
        q = fiber_core.Queue()
        t0 = time.time()
        p = fiber_core.Process(target=first_line, args=(q,), backend=name)
        p.start()
        started = q.get(timeout=WAIT)
        p.join(WAIT)
        results[("job", label)][name].append((started - t0) * 1e3)
    spares.settle(WAIT)
    t0 = time.perf_counter()
    p = fiber_core.Process(target=noop, backend=name)
    p.start()
    p.join(WAIT)
    if p.exitcode != 0:
        raise RuntimeError(f"a no-op Process on {name} exited with {p.exitcode}")
    results[("job", "Process start() + join(), no-op, on a ready spare (ms)")][name].append(
        (time.perf_counter() - t0) * 1e3)
    spares.settle(WAIT)


def bare_command(backend: Any, python: str, results: dict) -> None:
    """On an open connection to each host: one ``exec true`` (the login shell's own cost),
    and the platform's own start of a Python program, bare and importing fiber_core first
    (as a Fiber program's main module does), to its first line."""
    for host in backend._hosts:
        t = next(x for x in host.transports if x.is_active())
        t0 = time.perf_counter()
        backend._conn.run(host, t, "true")
        results[("job", "exec `true` on an open connection (ms)")]["ssh"].append(
            (time.perf_counter() - t0) * 1e3)
        for label, program in ((EXEC_PYTHON, FIRST_LINE), (EXEC_IMPORT, "import fiber_core; " + FIRST_LINE)):
            t0 = time.time()
            code, out, err = backend._conn.run(host, t, shlex.join([python, "-c", program]))
            if code != 0:
                raise RuntimeError(f"exec of python on {host.name} failed ({code}): {err}")
            started = next(float(line.split()[1]) for line in out.splitlines() if line.startswith("t "))
            results[("job", label)]["ssh"].append((started - t0) * 1e3)


EXEC_PYTHON = "exec `python -c <first line>` on an open connection -> first line (ms)"
EXEC_IMPORT = "the same, importing fiber_core first -> first line after it (ms)"


# -- the overhead workload ---------------------------------------------------------------------


def pool_turn(name: str, results: dict) -> None:
    import fiber_core

    t0 = time.perf_counter()
    pool = fiber_core.Pool(WORKERS, backend=name)
    try:
        pool.apply(noop)
        results[("pool", "Pool(5) -> first result (s)")][name].append(time.perf_counter() - t0)
        seen: set[Any] = set()
        deadline = time.monotonic() + WAIT
        while len(seen) < WORKERS:  # warm-up: every worker has answered
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(seen)} of {WORKERS} {name} workers answered")
            seen.update(pool.map(_who, [0.02] * (2 * WORKERS), 1))
        pool.map(time.sleep, [0.0] * (2 * WORKERS))
        for seconds, batch in CASES:
            t = time.perf_counter()
            out = pool.map_async(time.sleep, [seconds] * batch).get(WAIT * 5)
            results[("sleep", seconds)][name].append(time.perf_counter() - t)
            assert len(out) == batch
        if name == "ssh":
            results[("pool", "hosts the 5 workers ran on")]["ssh"].append(len({h for h, _ in seen}))
    finally:
        pool.terminate()
        pool.join()


def _who(seconds: float) -> tuple[str, int]:
    import socket

    time.sleep(seconds)
    return socket.gethostname(), os.getpid()


# -- the run ---------------------------------------------------------------------------------


def run(reps: int, jobs_per_rep: int, pool: bool = True) -> dict:
    from fiber_core.runtime.config import create_backend

    results: dict = defaultdict(lambda: defaultdict(list))
    backends = {name: create_backend(name, f"bench-{name}") for name in BACKENDS}
    pythons = {"local": sys.executable, "ssh": os.environ["FIBER_SSH_PYTHON"]}
    try:
        for name, b in backends.items():  # connect, and a job and a Process each, before measuring
            scratch: dict = defaultdict(lambda: defaultdict(list))
            job_start(b, pythons[name], scratch, name)
            process_start(scratch, name)
        for r in range(reps):
            t = time.perf_counter()
            order = BACKENDS if r % 2 == 0 else BACKENDS[::-1]
            for name in order:
                for _ in range(jobs_per_rep):
                    job_start(backends[name], pythons[name], results, name)
                process_start(results, name)
                if name == "ssh":
                    bare_command(backends["ssh"], pythons["ssh"], results)
                if pool:
                    pool_turn(name, results)
            print(f"repetition {r + 1}/{reps}: {time.perf_counter() - t:.1f} s "
                  f"(load average {os.getloadavg()[0]:.2f})", file=sys.stderr)
    finally:
        for b in backends.values():
            b.cleanup()
    return results


def report(results: dict, hosts: str, reps: int) -> str:
    lines = [
        f"`bench_ssh.py`, {reps} repetitions; Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end; "
        f"SSH hosts: {hosts}",
        "",
        "| what | local | ssh | ssh / local |",
        "|---|---:|---:|---:|",
    ]

    def row(label: str, key: tuple, fmt: str) -> None:
        vals = {n: statistics.median(results[key][n]) if results[key][n] else None for n in BACKENDS}
        shown = [fmt.format(vals[n]) if vals[n] is not None else "" for n in BACKENDS]
        ratio = f"{vals['ssh'] / vals['local']:.2f}" if vals["ssh"] and vals["local"] else ""
        lines.append(f"| {label} | {shown[0]} | {shown[1]} | {ratio} |")

    for key in sorted((k for k in results if k[0] == "job"), key=lambda k: _JOB_ORDER.index(k[1])):
        row(key[1], key, "{:.0f}")
    for seconds, batch in CASES if results[("pool", "Pool(5) -> first result (s)")]["ssh"] else ():
        if seconds == CASES[0][0]:
            row("Pool(5) -> first result (s)", ("pool", "Pool(5) -> first result (s)"), "{:.2f}")
        row(f"map: {batch} x sleep {seconds * 1000:g} ms (s; ideal 1.00)", ("sleep", seconds), "{:.3f}")
    if results[("job", PROCESS_COLD)]["ssh"] and results[("job", EXEC_PYTHON)]["ssh"]:
        cold, warm, bare, imp = (statistics.median(results[("job", k)]["ssh"])
                                 for k in (PROCESS_COLD, PROCESS_WARM, EXEC_PYTHON, EXEC_IMPORT))
        lines.append("")
        lines.append(f"On ssh, `Process.start()` -> target's first line is, on a ready spare, {warm / bare:.2f}x "
                     f"the exec of a bare Python program ({warm / imp:.2f}x the exec of one that imports "
                     f"fiber_core); with no spare, {cold / bare:.2f}x ({cold / imp:.2f}x).")
    spread = results[("pool", "hosts the 5 workers ran on")]["ssh"]
    if spread:
        lines.append("")
        lines.append(f"The 5 SSH workers ran on {min(spread)} to {max(spread)} hosts.")
    return "\n".join(lines)


_JOB_ORDER = [
    "create_job() returns (ms)",
    "start -> first instruction (ms)",
    "start -> exit code known (ms)",
    "exec `true` on an open connection (ms)",
    EXEC_PYTHON,
    EXEC_IMPORT,
    PROCESS_COLD,
    PROCESS_WARM,
    "Process start() + join(), no-op, on a ready spare (ms)",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 repetition, 2 jobs")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 5)")
    parser.add_argument("--jobs", type=int, default=None, help="jobs started per repetition and backend (default 5)")
    parser.add_argument("--starts-only", action="store_true", help="only the start latencies, no Pool workload")
    args = parser.parse_args(argv)
    reps = args.reps or (1 if args.quick else 5)
    jobs = args.jobs or (2 if args.quick else 5)
    hosts = configure_test_hosts()
    print(report(run(reps, jobs, pool=not args.starts_only), hosts, reps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
