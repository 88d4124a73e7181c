"""What delayed and reordered packets between the master and its SSH workers cost a Pool map.

    python benchmarks/ssh_packet_delay.py [--reps 3] [--tasks 300] [--seed 1]

Needs the SSH test hosts (``bash scripts/test-services.sh up ssh``, root). One ``Pool(6)``
on the three hosts (two slots each) runs ``map`` and ``imap_unordered`` of ``tasks`` tasks of
20 ms with ``chunksize=1``: undisturbed, with every packet of the hub's connections delayed
50-200 ms in each host's network namespace, and with 20 % of them held 20-80 ms more and
released after later ones (``fiber_core.testing.netdelay``: ``tc netem`` is missing from many
kernels). The cases are interleaved, their order rotating every repetition, on the same pool;
each call's results are checked (every item once). Prints the median, minimum and maximum time
of each case and call, and the tool's counters (per host) of the case's last repetition.

Traffic goes only to the test hosts (10.231.77.0/24).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import socket
import statistics
import sys
import time
from pathlib import Path

SERVICES = Path(os.environ.get("FIBER_SERVICES_DIR", "/tmp/fiber-services"))
PARENT = "10.231.77.1"
CALLS = ("map", "imap_unordered")


def task(x: int) -> tuple[int, str]:
    time.sleep(0.02)
    return x, socket.gethostname()


def use_test_hosts() -> list[str]:
    """Point FIBER_* at the test hosts; their namespace names."""
    env_file = SERVICES / "ssh" / "hosts.env"
    if not env_file.exists():
        sys.exit(f"no SSH test hosts ({env_file} is missing): run `bash scripts/test-services.sh up ssh`")
    f = {}
    for line in env_file.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            f[key.strip()] = shlex.split(value)[0] if value.strip() else ""
    os.environ.update({
        "FIBER_BACKEND": "ssh",
        "FIBER_SSH_HOSTS": ", ".join(f"{h}*2" for h in f["FIBER_SSH_HOSTS"].split()),
        "FIBER_SSH_USER": f["FIBER_SSH_USER"], "FIBER_SSH_KEY": f["FIBER_SSH_KEY"],
        "FIBER_SSH_KNOWN_HOSTS": f["FIBER_SSH_KNOWN_HOSTS"], "FIBER_SSH_PYTHON": sys.executable,
        "FIBER_SSH_SSH_CONFIG": "",
    })
    return f["FIBER_SSH_HOSTNAMES"].split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    names = use_test_hosts()

    import fiber_core
    from fiber_core.runtime import run
    from fiber_core.testing.netdelay import PacketDelay, Shape

    cases: dict[str, Shape | None] = {
        "undisturbed": None,
        "delay 50-200 ms": Shape(delay=(0.05, 0.2)),
        "20 % reordered": Shape(delay=(0.0, 0.005), reorder=0.2, hold=(0.02, 0.08)),
    }
    rt = run.runtime()
    tcp = [a for a in rt.addresses_for(rt.get_backend(None)).split(",") if a.startswith("tcp:")]
    port = int(tcp[0].rsplit(":", 1)[1])
    times: dict[tuple[str, str], list[float]] = {(k, c): [] for k in cases for c in CALLS}
    counters: dict[str, list[object]] = {}
    with fiber_core.Pool(6) as pool:
        pool.map(abs, range(60), chunksize=1)  # every worker up and connected
        order = list(cases)
        for rep in range(args.reps):
            for name in order[rep % len(order):] + order[:rep % len(order)]:
                shape = cases[name]
                with contextlib.ExitStack() as stack:
                    delays = [stack.enter_context(PacketDelay(port, PARENT, netns=host, shape=shape,
                                                              seed=args.seed + k))
                              for k, host in enumerate(names)] if shape else []
                    for call in CALLS:
                        t = time.monotonic()
                        got = list(getattr(pool, call)(task, range(args.tasks), chunksize=1))
                        times[name, call].append(time.monotonic() - t)
                        assert sorted(x for x, _ in got) == list(range(args.tasks)), (name, call)
                counters[name] = [d.final for d in delays]
    print(f"Pool(6) on {len(names)} SSH hosts, {args.tasks} tasks of 20 ms, chunksize=1, "
          f"{args.reps} interleaved repetitions, seed {args.seed}")
    for name in cases:
        for call in CALLS:
            ts = times[name, call]
            med, base = statistics.median(ts), statistics.median(times["undisturbed", call])
            print(f"  {name:<16} {call:<15} median {med:6.2f} s  min {min(ts):6.2f}  "
                  f"max {max(ts):6.2f}  x{med / base:4.1f}")
        for c in counters.get(name, []):
            print(f"      {c}  (both calls)")


if __name__ == "__main__":
    main()
