"""``fiber_core.context``: the names of :mod:`multiprocessing.context`."""

from __future__ import annotations

from fiber_core.parallel.context import FiberContext, get_context
from fiber_core.processes.process import cpu_count

__all__ = ["FiberContext", "cpu_count", "get_context"]
