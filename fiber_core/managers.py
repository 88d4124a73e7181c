"""``fiber_core.managers``: the names of :mod:`multiprocessing.managers`, served by Fiber jobs."""

from __future__ import annotations

from fiber_core.parallel.managers import (
    AsyncHandle,
    AsyncManager,
    AsyncProxy,
    BaseManager,
    BaseProxy,
    Manager,
    Namespace,
    RemoteError,
    SharedMemoryManager,
    State,
    SyncManager,
    Token,
)

__all__ = [
    "AsyncHandle", "AsyncManager", "AsyncProxy", "BaseManager", "BaseProxy", "Manager",
    "Namespace", "RemoteError", "SharedMemoryManager", "State", "SyncManager", "Token",
]
