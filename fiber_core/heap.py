"""``fiber_core.heap``: :class:`BufferWrapper`, the shared memory block of :mod:`multiprocessing.heap`."""

from __future__ import annotations

from fiber_core.parallel.sharedctypes import BufferWrapper

__all__ = ["BufferWrapper"]
