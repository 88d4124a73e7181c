"""Functions the conformance suite runs inside jobs.

Kept apart from the suite so that a job imports them without pytest, which
job images (containers, pods, Batch jobs) usually lack. The suite sends them by
value (see ``BackendConformance.targets_by_value``), so a job needs a working
``fiber_core``, not this version of this module.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import fiber_core


def put_square(q: Any, x: int) -> None:
    q.put(x * x)


def exit_with(code: int) -> None:
    sys.exit(code)


def hold(q: Any) -> None:
    """Say ``"up"`` on ``q``, then run until stopped."""
    q.put("up")
    time.sleep(3600)


def echo_squares(inbox: Any, outbox: Any) -> None:
    """Put the square of each number from ``inbox`` on ``outbox``, until ``None``."""
    for x in iter(inbox.get, None):
        outbox.put(x * x)


def echo_doubles(conn: Any) -> None:
    """On the Pipe end ``conn``: send this process's name, then twice each number received, until ``None``."""
    conn.send(fiber_core.current_process().name)
    for x in iter(conn.recv, None):
        conn.send(2 * x)
    conn.close()


def slow_square(x: int) -> tuple[int, str]:
    """``x * x`` and the name of the worker that computed it."""
    time.sleep(0.2)  # the workload: long enough that a worker is mid-task when it is lost
    return x * x, fiber_core.current_process().name


def double_entry(d: Any, key: str) -> None:
    """Through a dict proxy: read ``d[key]``, write twice it under ``"job"``."""
    d["job"] = 2 * d[key]
