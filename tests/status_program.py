"""A program for the live view's tests: three pool workers map slow tasks while its state is shown.

Run as a script, ``FIBER_STATUS=1 python status_program.py`` (``FIBER_STATUS_PORT=0`` for the
page too), as a user switches the live view on. It prints ``run <id>`` once the map runs,
and stops (terminating the pool) when its standard input closes.
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


def main() -> None:
    with fiber_core.Pool(3) as pool:
        pool.map_async(slow, range(TASKS), chunksize=1)
        print("run", runtime().run_id, flush=True)
        sys.stdin.read()  # until the test closes it


if __name__ == "__main__":
    main()
