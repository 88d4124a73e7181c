"""How soon a Pool uses a Docker daemon that answers again, probing it or not.

    python benchmarks/backend_return.py [--reps 5] [--refusals 4]

Needs the test Docker daemon (``bash scripts/test-services.sh up docker``, root). A Unix
socket in front of the daemon forwards its connections; each round runs a ``Pool(2,
maxtasksperchild=1)`` through it (every task needs a new container), then the socket
refuses connections, as a restarting daemon's does, until the pool has been refused
``refusals`` times (its backoff grown to seconds), and then forwards again. Timed from
that moment: until the call's 4 results are in (*done*: its tasks need new containers,
started one after another as workers end), and where the backoff alone would have tried
again (*next slot*). Rounds alternate between the backend as it is (it answers
``Backend.probe``: the pool probes while it waits) and the same backend that cannot tell
(``probe`` returns None: the pool waits for its backoff slot, as before). Medians, min
and max over ``reps`` rounds of each.

Nothing leaves the machine: the daemon's socket is local.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fiber_core.testing.outage import Outage

SERVICES = Path(os.environ.get("FIBER_SERVICES_DIR", "/tmp/fiber-services"))


def square(x: int) -> int:
    return x * x


class _Refusals(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "waiting for the backend" in record.getMessage():
            self.count += 1


def one_round(target: str, probing: bool, refusals: int) -> tuple[float, float]:
    import fiber_core
    from fiber_core.runtime.config import config
    from fiber_core.runtime.run import runtime

    counter = _Refusals()
    logging.getLogger("fiber").addHandler(counter)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "docker.sock")
        relay = Outage.unix(path, target)
        fiber_core.init(docker_base_url=f"unix://{path}")
        try:
            backend = runtime().get_backend("docker")
            if not probing:
                backend.probe = lambda: None  # type: ignore[method-assign]
            with fiber_core.Pool(2, backend="docker", maxtasksperchild=1) as pool:
                pool.map(square, range(2), chunksize=1)
                relay.cut()
                results = pool.imap(square, range(4), chunksize=1)
                while counter.count < refusals:
                    time.sleep(0.01)
                with pool._lock:
                    slot = pool._start_retry_at or time.monotonic()
                relay.restore()
                back = time.monotonic()
                list(results)
                resumed = time.monotonic() - back
            backend.cleanup()  # through the relay, while it forwards
            return resumed, slot - back
        finally:
            relay.cut()
            config.reset()
            logging.getLogger("fiber").removeHandler(counter)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--refusals", type=int, default=4)
    args = parser.parse_args()
    env = dict(line.split("=", 1) for line in (SERVICES / "docker" / "env").read_text().splitlines() if "=" in line)
    target = env["DOCKER_HOST"].removeprefix("unix://")
    os.environ.setdefault("FIBER_DOCKER_IMAGE", "fiber-test:latest")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the containers import this module
    rows: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(args.reps):
        for probing in (False, True):
            rows[probing].append(one_round(target, probing, args.refusals))
    print(f"{args.reps} rounds each, interleaved; the daemon answers again after {args.refusals} refusals")
    for probing, name in ((False, "backoff only (before)"), (True, "probing (Backend.probe)")):
        resumed = [r[0] for r in rows[probing]]
        slot = [r[1] for r in rows[probing]]
        print(f"  {name:24s} done median {statistics.median(resumed):5.2f} s (min {min(resumed):.2f}, "
              f"max {max(resumed):.2f}); next backoff slot was {statistics.median(slot):.2f} s away")


if __name__ == "__main__":
    main()
