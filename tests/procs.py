"""Helpers for tests that wait on operating-system processes, or on state with no event to
wait on (no pytest: jobs may import it)."""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable

T = 30.0
"""Bound of every wait here: reaching it is a failure, never a measure of speed."""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its new parent to reap it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pid: int, timeout: float = T) -> None:
    """Wait until process ``pid`` (not necessarily our child) has ended, on its pidfd."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        assert select.select([fd], [], [], timeout)[0], f"process {pid} did not end within {timeout} s"
    finally:
        os.close(fd)


def wait_until(predicate: Callable[[], object], what: str, timeout: float = T) -> None:
    """Poll state that has no event to wait on; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        pause.wait(0.01)
