"""``fiber_core.pool``: the names of :mod:`multiprocessing.pool`, with job-backed workers."""

from __future__ import annotations

from fiber_core.parallel.pool import (
    ApplyResult,
    AsyncResult,
    IMapIterator,
    IMapUnorderedIterator,
    MapResult,
    MaybeEncodingError,
    Pool,
    RemoteTraceback,
)

__all__ = [
    "ApplyResult", "AsyncResult", "IMapIterator", "IMapUnorderedIterator", "MapResult",
    "MaybeEncodingError", "Pool", "RemoteTraceback",
]
