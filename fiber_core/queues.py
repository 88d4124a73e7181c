"""``fiber_core.queues``: the names of :mod:`multiprocessing.queues`, reachable from every job."""

from __future__ import annotations

from fiber_core.parallel.queues import Empty, Full, JoinableQueue, Queue, SimpleQueue

__all__ = ["Empty", "Full", "JoinableQueue", "Queue", "SimpleQueue"]
