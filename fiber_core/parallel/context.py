"""``get_context()`` and the module-level API, as in :mod:`multiprocessing.context`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fiber_core.base import errors
from fiber_core.base.log import get_logger, log_to_stderr
from fiber_core.parallel.queues import JoinableQueue, Queue, SimpleQueue
from fiber_core.processes.pipe import Pipe
from fiber_core.processes.process import (
    Process,
    active_children,
    cpu_count,
    current_process,
    parent_process,
)
from fiber_core.runtime.config import config

_METHODS = ("fiber", "spawn", "forkserver")


class FiberContext:
    """The object ``get_context()`` returns: the same factories as the module.

    Fiber processes always start a fresh interpreter as a job, so the start
    methods that do so (``spawn``, ``forkserver``) are accepted as synonyms;
    ``fork`` (a copy of the parent's memory) cannot cross machines and is refused.
    """

    ProcessError = errors.ProcessError
    BufferTooShort = errors.BufferTooShort
    TimeoutError = errors.TimeoutError
    AuthenticationError = errors.AuthenticationError

    def __init__(self, method: str = "fiber") -> None:
        self._method = method

    @property
    def Process(self) -> type:  # noqa: N802 - multiprocessing's name

        return Process

    def get_start_method(self, allow_none: bool = False) -> str:
        return self._method

    def set_start_method(self, method: str | None, force: bool = False) -> None:
        _check_method(method)

    def get_all_start_methods(self) -> list[str]:
        return list(_METHODS)

    def get_context(self, method: str | None = None) -> FiberContext:
        return get_context(method)

    def cpu_count(self) -> int:
        return cpu_count()

    def current_process(self) -> Any:

        return current_process()

    def parent_process(self) -> Any:

        return parent_process()

    def active_children(self) -> list:

        return active_children()

    def Pipe(self, duplex: bool = True) -> tuple:  # noqa: N802

        return Pipe(duplex)

    def Queue(self, maxsize: int = 0) -> Any:  # noqa: N802

        return Queue(maxsize, ctx=self)

    def JoinableQueue(self, maxsize: int = 0) -> Any:  # noqa: N802

        return JoinableQueue(maxsize, ctx=self)

    def SimpleQueue(self) -> Any:  # noqa: N802

        return SimpleQueue(ctx=self)

    def Pool(self, processes: int | None = None, initializer: Callable | None = None,  # noqa: N802
             initargs: tuple = (), maxtasksperchild: int | None = None, **kwargs: Any) -> Any:
        from fiber_core.parallel.pool import Pool

        return Pool(processes, initializer, initargs, maxtasksperchild, **kwargs)

    def Manager(self) -> Any:  # noqa: N802
        from fiber_core.parallel.managers import SyncManager

        m = SyncManager()
        m.start()
        return m

    # Synchronization objects and shared ctypes: loaded on first use (ctypes, the
    # semaphores), so that a job that does not use them starts without them.

    def Lock(self) -> Any:  # noqa: N802
        from fiber_core.parallel.synchronize import Lock

        return Lock(ctx=self)

    def RLock(self) -> Any:  # noqa: N802
        from fiber_core.parallel.synchronize import RLock

        return RLock(ctx=self)

    def Condition(self, lock: Any = None) -> Any:  # noqa: N802
        from fiber_core.parallel.synchronize import Condition

        return Condition(lock, ctx=self)

    def Semaphore(self, value: int = 1) -> Any:  # noqa: N802
        from fiber_core.parallel.synchronize import Semaphore

        return Semaphore(value, ctx=self)

    def BoundedSemaphore(self, value: int = 1) -> Any:  # noqa: N802
        from fiber_core.parallel.synchronize import BoundedSemaphore

        return BoundedSemaphore(value, ctx=self)

    def Event(self) -> Any:  # noqa: N802
        from fiber_core.parallel.synchronize import Event

        return Event(ctx=self)

    def Barrier(self, parties: int, action: Callable | None = None,  # noqa: N802
                timeout: float | None = None) -> Any:
        from fiber_core.parallel.synchronize import Barrier

        return Barrier(parties, action, timeout, ctx=self)

    def RawValue(self, typecode_or_type: Any, *args: Any) -> Any:  # noqa: N802
        from fiber_core.parallel.sharedctypes import RawValue

        return RawValue(typecode_or_type, *args)

    def RawArray(self, typecode_or_type: Any, size_or_initializer: Any) -> Any:  # noqa: N802
        from fiber_core.parallel.sharedctypes import RawArray

        return RawArray(typecode_or_type, size_or_initializer)

    def Value(self, typecode_or_type: Any, *args: Any, lock: Any = True) -> Any:  # noqa: N802
        from fiber_core.parallel.sharedctypes import Value

        return Value(typecode_or_type, *args, lock=lock, ctx=self)

    def Array(self, typecode_or_type: Any, size_or_initializer: Any, *,  # noqa: N802
              lock: Any = True) -> Any:
        from fiber_core.parallel.sharedctypes import Array

        return Array(typecode_or_type, size_or_initializer, lock=lock, ctx=self)

    def freeze_support(self) -> None:
        pass

    def get_logger(self) -> Any:

        return get_logger()

    def log_to_stderr(self, level: int | None = None) -> Any:

        return log_to_stderr(level)

    def allow_connection_pickling(self) -> None:
        pass

    def set_executable(self, executable: str) -> None:

        config.init(python=executable)

    def set_forkserver_preload(self, module_names: list[str]) -> None:
        pass


def _check_method(method: str | None) -> None:
    if method is None or method in _METHODS:
        return
    if method == "fork":
        raise ValueError(
            "start method 'fork' is not available: fiber processes are jobs that start a fresh "
            "interpreter, possibly on another machine, so they cannot inherit this process's "
            "memory. Use 'spawn' (or no start method): pass what the child needs as arguments."
        )
    raise ValueError(f"cannot find context for {method!r} (available: {', '.join(_METHODS)})")


_default = FiberContext()


def get_context(method: str | None = None) -> FiberContext:
    """Return a context; every accepted start method gives Fiber's job-backed processes."""
    _check_method(method)
    return _default if method in (None, "fiber") else FiberContext(method)
