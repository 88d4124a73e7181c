"""A program for the live view's tests: three pool workers map slow tasks while its state is shown.

Run as a script, ``FIBER_STATUS=1 python status_program.py`` (``FIBER_STATUS_PORT=0`` for the
page too), as a user switches the live view on. It prints ``run <id>`` once the map runs,
and stops (terminating the pool) when its standard input closes. With ``--losses`` its
tasks print a line each, and it kills the first worker that printed.
"""

from __future__ import annotations

import sys
import time

import fiber_core
from fiber_core.runtime.run import runtime

TASKS = 100_000


def slow(x: int) -> int:
    time.sleep(0.02)  # the work itself, not synchronisation
    return x


def chatty(x: int) -> int:
    print(f"item {x}: done", flush=True)
    time.sleep(0.02)  # the work itself, not synchronisation
    return x


def _lose_a_worker(pool: fiber_core.Pool) -> None:
    """Kill the first worker that printed something, as an operator might."""
    while True:
        printed = [w["name"] for w in pool.status_snapshot()["workers"] if w["output"]]
        if printed:
            break
        time.sleep(0.05)  # polls the pool's own view; nothing to wait on
    [victim] = [p for p in fiber_core.active_children() if p.name == printed[0]]
    victim.kill()


def main() -> None:
    losses = "--losses" in sys.argv
    with fiber_core.Pool(3) as pool:
        pool.map_async(chatty if losses else slow, range(TASKS), chunksize=1)
        sys.stdout.write(f"run {runtime().run_id}\n")  # one write: workers' lines come meanwhile
        sys.stdout.flush()
        if losses:
            _lose_a_worker(pool)
        sys.stdin.read()  # until the test closes it


if __name__ == "__main__":
    main()
