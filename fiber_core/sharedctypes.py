"""``fiber_core.sharedctypes``: the names of :mod:`multiprocessing.sharedctypes`, for every backend."""

from __future__ import annotations

from fiber_core.parallel.sharedctypes import (
    Array,
    RawArray,
    RawValue,
    SharedBufferError,
    Synchronized,
    SynchronizedArray,
    SynchronizedBase,
    SynchronizedString,
    Value,
    copy,
    synchronized,
    typecode_to_type,
)

__all__ = [
    "Array", "RawArray", "RawValue", "SharedBufferError", "Synchronized", "SynchronizedArray",
    "SynchronizedBase", "SynchronizedString", "Value", "copy", "synchronized", "typecode_to_type",
]
