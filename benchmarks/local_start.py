"""A local Pool's start: Fiber's workers forked from its template against new interpreters
and against ``multiprocessing`` with fork, forkserver (the default on Linux from Python 3.14)
and spawn. With ``--process``, a single Process's start instead.

Each measure runs in a program of its own, as a user's would: the time from ``Pool(n)``
until all n workers run a task at once (each task waits at a Barrier of n), for the
program's first Pool and for a second Pool in the same program; and the program's first
Pool counted from the making of its Barrier (multiprocessing starts its resource tracker
there). Modes alternate within each round; medians are printed.

With ``--process``: the time from ``Process.start()`` to the first line of its target (the
clock read before the call travels in the target's arguments; the target sends its own
reading back through a queue), for the program's first process and the median of the
``-n`` processes after it, each joined before the next starts; and the program's own time
to its first process's target: the library's import, its first ``Queue()`` and the first
start.

``--against DIR`` measures Fiber's modes also with the ``fiber_core`` of the checkout ``DIR``
(a reference: the base commit of a change), alternating with this one (the order flips
every round), and prints its rows marked ``(ref)``; ``--fiber-only`` leaves out
``multiprocessing``; ``--modes`` names the ones to measure (``fiber:template,mp:forkserver``).
Compile both checkouts first (``python -m compileall fiber_core``) where
``PYTHONDONTWRITEBYTECODE`` is set, or one side pays for compiling in every interpreter.

    python benchmarks/local_start.py -n 5 --rounds 7
    python benchmarks/local_start.py -n 64 --rounds 3
    python benchmarks/local_start.py -n 5 --rounds 15 --fiber-only --against ../base
    python benchmarks/local_start.py --process -n 30 --rounds 7 --against ../base
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
    import json, sys, time

    def meet(x):
        _barrier.wait(timeout=300)
        return x

    def init(barrier):
        global _barrier
        _barrier = barrier

    if __name__ == "__main__":
        lib, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
        if lib == "fiber":
            import fiber_core as mp  # the start mode comes in FIBER_LOCAL_START, as a user's setting
            ctx = mp
        else:
            import multiprocessing
            ctx = multiprocessing.get_context(mode)
        times = []
        begun = time.perf_counter()
        for _ in range(2):
            barrier = ctx.Barrier(n)
            start = time.perf_counter()
            pool = ctx.Pool(n, initializer=init, initargs=(barrier,))
            assert pool.map(meet, range(n), chunksize=1) == list(range(n))
            times.append(time.perf_counter() - start)
            if len(times) == 1:
                first_call = time.perf_counter() - begun
            pool.terminate()
            pool.join()
        print(json.dumps(times + [first_call]))
""")


PROCESS_PROGRAM = textwrap.dedent("""
    import json, sys, time
    begun = time.perf_counter()  # before the library's import

    def first_line(q, t0):
        q.put(time.perf_counter() - t0)

    if __name__ == "__main__":
        lib, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
        if lib == "fiber":
            import fiber_core as ctx  # the start mode comes in FIBER_LOCAL_START, as a user's setting
        else:
            import multiprocessing
            ctx = multiprocessing.get_context(mode)
        q = ctx.Queue()
        times = []
        for _ in range(n + 1):
            t0 = time.perf_counter()
            p = ctx.Process(target=first_line, args=(q, t0))
            p.start()
            times.append(q.get(timeout=300))
            if len(times) == 1:
                program = t0 - begun + times[0]
            p.join()
        rest = sorted(times[1:])
        print(json.dumps([times[0], rest[len(rest) // 2], program]))
""")


HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(lib: str, mode: str, n: int, where: str, repo: str = HERE) -> list[float]:
    out = subprocess.run([sys.executable, where, lib, mode, str(n)], capture_output=True, text=True,
                         timeout=900, env={**os.environ, "PYTHONPATH": repo, "FIBER_LOCAL_START": mode},
                         cwd=repo)  # jobs run `python -m`, which imports from the working directory first
    if out.returncode != 0:
        raise RuntimeError(f"{lib} {mode}: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def main() -> None:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--against", help="a checkout whose fiber_core is measured too, alternating")
    ap.add_argument("--fiber-only", action="store_true", help="leave out multiprocessing")
    ap.add_argument("--modes", help="only these, comma-separated lib:mode (fiber, fiber (ref), mp)")
    ap.add_argument("--process", action="store_true",
                    help="a Process's start to its target's first line instead of a Pool's (-n: starts after the first)")
    args = ap.parse_args()
    modes = [("fiber", "template"), ("fiber", "fresh")]
    if args.against:
        modes += [("fiber (ref)", "template"), ("fiber (ref)", "fresh")]
    if not args.fiber_only:
        modes += [("mp", "fork"), ("mp", "forkserver"), ("mp", "spawn")]
    if args.modes:
        wanted = [tuple(m.split(":")) for m in args.modes.split(",")]
        unknown = [m for m in wanted if m not in modes]
        if unknown:
            ap.error(f"unknown modes {unknown}; known: {', '.join(':'.join(m) for m in modes)}")
        modes = [m for m in modes if m in wanted]
    repos = {"fiber": HERE, "fiber (ref)": os.path.abspath(args.against or HERE)}
    results: dict[tuple[str, str], list[list[float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as where:
        program = os.path.join(where, "start.py")
        with open(program, "w") as f:
            f.write(PROCESS_PROGRAM if args.process else PROGRAM)
        for r in range(args.rounds):
            for lib, mode in modes if r % 2 == 0 else modes[::-1]:
                name = "fiber" if lib.startswith("fiber") else lib
                results[(lib, mode)].append(measure(name, mode, args.n, program, repos.get(lib, HERE)))
    if args.process:
        report_process(modes, results, args.n, args.rounds)
        return
    print(f"Pool({args.n}) until all {args.n} workers run a task, medians of {args.rounds} "
          f"(load average {os.getloadavg()[0]:.1f}):")
    print(f"  {'':22s} {'first Pool':>11s} {'second Pool':>12s} {'first, its Barrier too':>23s}")
    for lib, mode in modes:
        first = statistics.median(r[0] for r in results[(lib, mode)])
        second = statistics.median(r[1] for r in results[(lib, mode)])
        whole = statistics.median(r[-1] for r in results[(lib, mode)])
        print(f"  {lib + ' ' + mode:22s} {first:9.3f} s {second:10.3f} s {whole:21.3f} s")


def report_process(modes: list[tuple[str, str]], results: dict[tuple[str, str], list[list[float]]],
                   n: int, rounds: int) -> None:
    print(f"Process.start() -> its target's first line (ms), medians of {rounds} programs "
          f"(load average {os.getloadavg()[0]:.1f}):")
    print(f"  {'':22s} {'first':>8s} {f'next {n} (their median)':>24s} {'import, Queue(), first start':>29s}")
    for lib, mode in modes:
        first = statistics.median(r[0] for r in results[(lib, mode)]) * 1e3
        rest = statistics.median(r[1] for r in results[(lib, mode)]) * 1e3
        program = statistics.median(r[2] for r in results[(lib, mode)]) * 1e3
        print(f"  {lib + ' ' + mode:22s} {first:8.2f} {rest:24.2f} {program:29.2f}")


if __name__ == "__main__":
    main()
