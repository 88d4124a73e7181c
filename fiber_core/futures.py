"""``fiber_core.futures``: the names of :mod:`concurrent.futures`, with a Fiber process pool.

``from fiber_core.futures import ProcessPoolExecutor`` is the whole port of a program
that uses ``concurrent.futures.ProcessPoolExecutor``: its workers become jobs on the
selected backend. The other names are the stdlib's own (``Future``, ``wait``,
``as_completed``...), so ``import fiber_core.futures as futures`` can stand for
``concurrent.futures``. How failures map to ``BrokenProcessPool`` is described in
:mod:`fiber_core.parallel.executor`.
"""

from __future__ import annotations

from concurrent.futures import (
    ALL_COMPLETED,
    FIRST_COMPLETED,
    FIRST_EXCEPTION,
    BrokenExecutor,
    CancelledError,
    Executor,
    Future,
    InvalidStateError,
    ThreadPoolExecutor,
    TimeoutError,
    as_completed,
    wait,
)
from concurrent.futures.process import BrokenProcessPool

from fiber_core.parallel.executor import FiberExecutor, ProcessPoolExecutor

__all__ = [
    "ALL_COMPLETED", "FIRST_COMPLETED", "FIRST_EXCEPTION", "BrokenExecutor", "BrokenProcessPool",
    "CancelledError", "Executor", "FiberExecutor", "Future", "InvalidStateError",
    "ProcessPoolExecutor", "ThreadPoolExecutor", "TimeoutError", "as_completed", "wait",
]
