"""The job supervisor's own share of an SSH job's start, without SSH: its start -> the job's first line.

Runs the supervisor as the backend does (``python -I -S -c <its code> fiber-ssh <run>``,
the job line on its stdin) on this machine, with a job whose first act is to write a line,
and times each start from the supervisor's ``Popen`` to that line, and the CPU time the
supervisor and its job used in all (which a loaded machine changes less). With ``--against DIR``
the supervisor of the checkout ``DIR`` is measured too, alternating with this one (the
order flips every round); medians and minimums are printed.

    python plugins/fiber_ssh/benchmarks/bench_supervisor.py --starts 40 --against ../base
"""

from __future__ import annotations

import argparse
import base64
import marshal
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent / "fiber_ssh" / "supervisor.py"


def code(path: Path) -> str:
    """The supervisor's code as the backend sends it (fiber_ssh.spec.SUPERVISOR): no docstring."""
    return path.read_text().split('"""\n', 1)[1].lstrip()


def start(source: str, line: bytes) -> tuple[float, float]:
    """Seconds to the job's first line; CPU seconds of the supervisor and its job in all."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-I", "-S", "-c", source, "fiber-ssh", "bench"],
                         stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert p.stdin is not None and p.stderr is not None
    p.stdin.write(line)
    p.stdin.flush()
    first = p.stderr.readline()  # the job's stdout and stderr come on the supervisor's stderr
    took = time.perf_counter() - t
    p.stdin.close()
    p.wait(60)
    if first.strip() != b"first":
        raise RuntimeError(f"the job did not start: {first!r}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return took, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--starts", type=int, default=30, help="starts of each supervisor")
    parser.add_argument("--against", help="a checkout whose supervisor is measured too, alternating")
    args = parser.parse_args(argv)
    sources = {"this checkout": code(HERE)}
    if args.against:
        sources["reference"] = code(Path(args.against) / "plugins" / "fiber_ssh" / "fiber_ssh" / "supervisor.py")
    job = {"argv": ["/bin/sh", "-c", "echo first >&2"], "env": {}, "cwd": None, "orphan_timeout": None}
    line = base64.b64encode(marshal.dumps(job, 4)) + b"\n"
    times: dict[str, list[float]] = {name: [] for name in sources}
    cpu: dict[str, list[float]] = {name: [] for name in sources}
    names = list(sources)
    for i in range(args.starts):
        for name in names if i % 2 == 0 else names[::-1]:
            took, used = start(sources[name], line)
            times[name].append(took)
            cpu[name].append(used)
    print(f"Supervisor start -> its job's first line (ms), {args.starts} starts each, alternating; "
          f"Python {sys.version.split()[0]}, load average {os.getloadavg()[0]:.1f} at the end\n")
    print("| supervisor | median | min | CPU of the supervisor and its job, median | min |")
    print("|---|---:|---:|---:|---:|")
    med = statistics.median
    for name, v in times.items():
        c = cpu[name]
        print(f"| {name} | {med(v) * 1e3:.1f} | {min(v) * 1e3:.1f} | {med(c) * 1e3:.1f} | {min(c) * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
