"""How soon the ssh backend notices a host cut off, and one that answers again.

    python benchmarks/ssh_host_loss.py [--reps 5] [--keepalive 1] [--keepalive-count 3]

Needs the SSH test hosts (``bash scripts/test-services.sh up ssh``, root): each round
starts a job on every host, cuts ``fiber-h1`` off (its namespace drops every packet, as a
pulled cable), times until the job there ends as ``HOST_LOST`` (*noticed*), then lets the
host answer again and times until placement uses it again (*back*: the backend probed it,
logged in and marked it alive). Then the same with a ``Pool(6)`` mapping short tasks over
the three hosts (two slots each): after the cut, its six workers crowd the two hosts left;
*pool back* times from the host's return until two of them moved back (two workers on
each host again). Medians, minimum and maximum over ``reps`` rounds.

Traffic goes only to the test hosts (10.231.77.0/24).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

SERVICES = Path(os.environ.get("FIBER_SERVICES_DIR", "/tmp/fiber-services"))


def facts() -> dict[str, str]:
    out = {}
    for line in (SERVICES / "ssh" / "hosts.env").read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = shlex.split(value)[0] if value.strip() else ""
    return out


def ctl(f: dict[str, str], action: str, host: str) -> None:
    subprocess.run(["bash", f["FIBER_SSH_CTL"], action, host], check=True, timeout=60, capture_output=True)


def one_round(f: dict[str, str], keepalive: float, count: int) -> tuple[float, float]:
    from fiber_ssh.backend import SshBackend

    from fiber_core.contract import JobSpec

    settings = {
        "hosts": ", ".join(f"{h}*2" for h in f["FIBER_SSH_HOSTS"].split()), "user": f["FIBER_SSH_USER"],
        "key": f["FIBER_SSH_KEY"], "known_hosts": f["FIBER_SSH_KNOWN_HOSTS"], "python": sys.executable,
        "ssh_config": "", "keepalive": keepalive, "keepalive_count": count, "orphan_timeout": 5.0,
    }
    b = SshBackend(settings, "bench" + os.urandom(3).hex())
    b.peer_timeout = 30.0
    try:
        code = "import time; print('up', flush=True); time.sleep(600)"
        jobs = [b.start_job(JobSpec(command=[sys.executable, "-c", code], name="held")) for _ in range(3)]
        for job in jobs:
            while "up" not in b.get_job_logs(job):
                time.sleep(0.01)
        on_h1 = next(j for j in jobs if j.host == "fiber-h1")
        ctl(f, "cut", "fiber-h1")
        cut = time.monotonic()
        try:
            b.wait_for_job(on_h1, 120)
            noticed = time.monotonic() - cut
            time.sleep(1.0)  # the host stays away a little longer
        finally:
            ctl(f, "heal", "fiber-h1")
        healed = time.monotonic()
        while not b._slots[0].alive:
            time.sleep(0.01)
            if time.monotonic() - healed > 120:
                raise SystemExit("fiber-h1 was not used again within 120 s")
        return noticed, time.monotonic() - healed
    finally:
        b.cleanup()


def _host(x: int) -> str:
    import socket

    time.sleep(0.02)
    return socket.gethostname()


def pool_round(f: dict[str, str]) -> float:
    import threading

    import fiber_core
    from fiber_core.runtime.run import runtime

    b = runtime().get_backend("ssh")
    used = lambda: [s.used for s in b._slots]  # noqa: E731
    stop = threading.Event()
    with fiber_core.Pool(6) as pool:
        def work() -> None:
            while not stop.is_set():
                pool.map(_host, range(24), chunksize=1)

        runner = threading.Thread(target=work, daemon=True)
        runner.start()
        _until(lambda: used() == [2, 2, 2])
        ctl(f, "cut", "fiber-h1")
        try:
            _until(lambda: not b._slots[0].alive and used()[1:] == [3, 3])
        finally:
            ctl(f, "heal", "fiber-h1")
        healed = time.monotonic()
        _until(lambda: used() == [2, 2, 2])
        back = time.monotonic() - healed
        stop.set()
        runner.join(120)
    return back


def _until(predicate: object) -> None:
    deadline = time.monotonic() + 120
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--keepalive", type=float, default=1.0)
    parser.add_argument("--keepalive-count", type=int, default=3)
    args = parser.parse_args()
    f = facts()
    rows = [one_round(f, args.keepalive, args.keepalive_count) for _ in range(args.reps)]
    hosts = ", ".join(f"{h}*2" for h in f["FIBER_SSH_HOSTS"].split())
    os.environ.update({"FIBER_BACKEND": "ssh", "FIBER_SSH_HOSTS": hosts,
                       "FIBER_SSH_USER": f["FIBER_SSH_USER"], "FIBER_SSH_KEY": f["FIBER_SSH_KEY"],
                       "FIBER_SSH_KNOWN_HOSTS": f["FIBER_SSH_KNOWN_HOSTS"], "FIBER_SSH_PYTHON": sys.executable,
                       "FIBER_SSH_SSH_CONFIG": "", "FIBER_SSH_ORPHAN_TIMEOUT": "5",
                       "FIBER_SSH_KEEPALIVE": str(args.keepalive),
                       "FIBER_SSH_KEEPALIVE_COUNT": str(args.keepalive_count)})
    pool_back = [pool_round(f) for _ in range(args.reps)]
    print(f"keepalive {args.keepalive:g} s x keepalive_count {args.keepalive_count}, {args.reps} rounds")
    for name, values in (("noticed (cut -> its job HOST_LOST)", [r[0] for r in rows]),
                         ("back (answers -> placed on again)", [r[1] for r in rows]),
                         ("pool back (answers -> 2 workers each)", pool_back)):
        print(f"  {name:38s} median {statistics.median(values):5.2f} s   "
              f"min {min(values):5.2f}  max {max(values):5.2f}")


if __name__ == "__main__":
    main()
