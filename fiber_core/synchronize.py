"""``fiber_core.synchronize``: the names of :mod:`multiprocessing.synchronize`, for every backend."""

from __future__ import annotations

from fiber_core.parallel.synchronize import (
    SEM_VALUE_MAX,
    Barrier,
    BoundedSemaphore,
    Condition,
    Event,
    Lock,
    RLock,
    Semaphore,
    SemLock,
)

__all__ = [
    "SEM_VALUE_MAX", "Barrier", "BoundedSemaphore", "Condition", "Event", "Lock", "RLock",
    "SemLock", "Semaphore",
]
