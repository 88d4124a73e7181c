"""Run CPython's multiprocessing test suite against Fiber (and the stdlib, for reference).

    python scripts/cpython-suite.py                       # Fiber and stdlib, processes flavour
    python scripts/cpython-suite.py --impl fiber --flavour processes,manager
    python scripts/cpython-suite.py --backend docker --impl fiber
    python scripts/cpython-suite.py --class WithProcessesTestQueue

Each class runs in its own interpreter under a hang limit; the result table (Markdown)
and the raw results (JSON) are written to --out. docs/compatibility.md explains the
method and how the numbers are counted.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "compat"))

import cpython_suite  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", default="fiber,stdlib",
                        help="comma-separated: fiber, stdlib (default: both)")
    parser.add_argument("--flavour", default="processes",
                        help="comma-separated: processes, manager, threads, misc (default: processes)")
    parser.add_argument("--class", dest="classes", action="append", default=[],
                        help="run only this class (repeatable); overrides --flavour")
    parser.add_argument("--backend", help="Fiber's backend (FIBER_BACKEND); docker uses the test "
                        "service's daemon and fiber-test:latest unless DOCKER_HOST/FIBER_DOCKER_IMAGE are set")
    parser.add_argument("--start-method", default="spawn",
                        help="the start method the suite is installed with (default: spawn)")
    parser.add_argument("--jobs", type=int, default=2, help="classes run at once (default: 2)")
    parser.add_argument("--hang-after", type=float,
                        help="seconds without a result after which a test counts as hung (default: 60; "
                        "180 on docker, where test_many_processes starts 100 containers)")
    parser.add_argument("--out", type=Path, help="directory for results.md, results.json and logs")
    args = parser.parse_args(argv)

    impls = [i for i in args.impl.split(",") if i]
    flavours = [f for f in args.flavour.split(",") if f]
    for impl in impls:
        if impl not in ("fiber", "stdlib"):
            parser.error(f"--impl {impl!r}: expected fiber or stdlib")
    for flavour in flavours:
        if flavour not in (*cpython_suite.FLAVOURS, "misc"):
            parser.error(f"--flavour {flavour!r}: expected processes, manager, threads or misc")
    if args.hang_after is None:
        backend = args.backend or os.environ.get("FIBER_BACKEND")
        args.hang_after = 180.0 if backend == "docker" else 60.0
    out = args.out or Path(tempfile.mkdtemp(prefix="cpython-suite-"))
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for impl in impls:
        runs.append(cpython_suite.run_suite(
            impl, flavours, backend=args.backend, start_method=args.start_method, jobs=args.jobs,
            hang_after=args.hang_after, work=out / "work", only=args.classes, progress=sys.stderr))
    shown = sorted({cpython_suite.flavour_of(c.name) for r in runs for c in r.classes})
    (out / "results.json").write_text(cpython_suite.to_json(runs))
    (out / "results.md").write_text(cpython_suite.to_markdown(runs, shown))
    for flavour in shown:
        print(f"{flavour}:")
        for run in runs:
            print(f"  {cpython_suite.summary_line(run, flavour)}")
    for run in runs:
        slow = ", ".join(f"{n} {s:g} s" for n, s in cpython_suite.slowest_classes(run, 5))
        print(f"{run.impl}: {run.seconds:g} s wall; slowest classes: {slow}")
    print(f"results: {out / 'results.md'} (logs under {out / 'work'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
