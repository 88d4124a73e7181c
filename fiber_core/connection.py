"""``fiber_core.connection``: the names of :mod:`multiprocessing.connection`, over Fiber's transport."""

from __future__ import annotations

from fiber_core.processes.pipe import Pipe, PipeEnd
from fiber_core.wire.framing import Connection, wait

__all__ = ["Connection", "Pipe", "PipeEnd", "wait"]
