"""``get_context()`` and the module-level API, as in :mod:`multiprocessing.context`."""

from __future__ import annotations

import multiprocessing.context
import multiprocessing.reduction
import os
import sys
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
from fiber_core.runtime.run import runtime

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
        self._chosen = False  # set_start_method() was called
        self._fixed = False  # the module-level get_start_method(allow_none=True) answers the method

    @property
    def Process(self) -> type:  # noqa: N802 - multiprocessing's name

        return Process

    def get_start_method(self, allow_none: bool = False) -> str:
        # The first thing concurrent.futures.ProcessPoolExecutor asks of its mp_context
        # (3.10.13 and every 3.11-3.14): refuse there, before it builds pipes and locks.
        caller = sys._getframe(1)  # noqa: SLF001 - inspect.currentframe() without importing inspect
        if caller.f_globals.get("__name__") == "concurrent.futures.process":
            raise ValueError(
                "concurrent.futures.ProcessPoolExecutor cannot run its workers on Fiber's context: "
                "it gives them operating-system pipes and semaphores, which a job (possibly on "
                "another machine) cannot reach. Use fiber_core.futures.ProcessPoolExecutor, the "
                "same API over a Fiber Pool: `from fiber_core.futures import ProcessPoolExecutor`."
            )
        return self._method

    def _default_start_method(self, allow_none: bool = False) -> str | None:
        """The module-level ``get_start_method``, as the stdlib's default context answers it:
        ``None`` with ``allow_none`` while no method was set or asked for (so ``is None``
        means "nobody has chosen"); asking without ``allow_none`` fixes the method."""
        if allow_none and not self._fixed:
            return None
        self.fix_start_method()
        return self._method

    def fix_start_method(self) -> None:
        """Mark the method as chosen, as the stdlib's default context is once it is used:
        the module-level ``get_start_method(allow_none=True)`` then answers it."""
        self._fixed = True

    def set_start_method(self, method: str | None, force: bool = False) -> None:
        """Remember ``method`` (what ``get_start_method()`` returns); any accepted one runs jobs."""
        _check_method(method)
        if self._chosen and not force:
            raise RuntimeError("context has already been set")
        self._method = method or "fiber"
        self._chosen = self._fixed = method is not None

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
        from fiber_core.parallel.pool import (
            Pool,  # on first use: a job that makes no Pool never loads it
        )

        return Pool(processes, initializer, initargs, maxtasksperchild, **kwargs)

    def Manager(self) -> Any:  # noqa: N802
        from fiber_core.parallel.managers import SyncManager  # on first use, as Pool

        m = SyncManager()
        m.start()
        return m

    # Synchronization objects and shared ctypes: loaded on first use (ctypes, the
    # semaphores), so that a job that does not use them starts without them.

    def Lock(self) -> Any:  # noqa: N802
        from fiber_core.parallel.synchronize import Lock  # on first use, as Pool

        return Lock(ctx=self)

    def RLock(self) -> Any:  # noqa: N802
        from fiber_core.parallel.synchronize import RLock  # on first use, as Pool

        return RLock(ctx=self)

    def Condition(self, lock: Any = None) -> Any:  # noqa: N802
        from fiber_core.parallel.synchronize import Condition  # on first use, as Pool

        return Condition(lock, ctx=self)

    def Semaphore(self, value: int = 1) -> Any:  # noqa: N802
        from fiber_core.parallel.synchronize import Semaphore  # on first use, as Pool

        return Semaphore(value, ctx=self)

    def BoundedSemaphore(self, value: int = 1) -> Any:  # noqa: N802
        from fiber_core.parallel.synchronize import BoundedSemaphore  # on first use, as Pool

        return BoundedSemaphore(value, ctx=self)

    def Event(self) -> Any:  # noqa: N802
        from fiber_core.parallel.synchronize import Event  # on first use, as Pool

        return Event(ctx=self)

    def Barrier(self, parties: int, action: Callable | None = None,  # noqa: N802
                timeout: float | None = None) -> Any:
        from fiber_core.parallel.synchronize import Barrier  # on first use, as Pool

        return Barrier(parties, action, timeout, ctx=self)

    def RawValue(self, typecode_or_type: Any, *args: Any) -> Any:  # noqa: N802
        from fiber_core.parallel.sharedctypes import RawValue  # on first use, as Pool

        return RawValue(typecode_or_type, *args)

    def RawArray(self, typecode_or_type: Any, size_or_initializer: Any) -> Any:  # noqa: N802
        from fiber_core.parallel.sharedctypes import RawArray  # on first use, as Pool

        return RawArray(typecode_or_type, size_or_initializer)

    def Value(self, typecode_or_type: Any, *args: Any, lock: Any = True) -> Any:  # noqa: N802
        from fiber_core.parallel.sharedctypes import Value  # on first use, as Pool

        return Value(typecode_or_type, *args, lock=lock, ctx=self)

    def Array(self, typecode_or_type: Any, size_or_initializer: Any, *,  # noqa: N802
              lock: Any = True) -> Any:
        from fiber_core.parallel.sharedctypes import Array  # on first use, as Pool

        return Array(typecode_or_type, size_or_initializer, lock=lock, ctx=self)

    def freeze_support(self) -> None:
        pass

    def get_logger(self) -> Any:

        return get_logger()

    def log_to_stderr(self, level: int | None = None) -> Any:

        return log_to_stderr(level)

    def allow_connection_pickling(self) -> None:
        """Nothing to do: connections and sockets can always be sent (as in the stdlib)."""

    def set_executable(self, executable: str | bytes | os.PathLike[str] | os.PathLike[bytes]) -> None:
        """The interpreter jobs on this machine run: Fiber's ``python`` setting.

        As in the stdlib, a path on this machine; so only for a backend whose jobs share
        it (the local one). Elsewhere jobs run the interpreter of their image or host,
        which the ``python`` setting names (``init(python=...)``, ``FIBER_PYTHON``).
        """
        path = os.fsdecode(os.fspath(executable))
        backend = runtime().get_backend(None)
        if not backend.shares_this_machine:
            raise ValueError(
                f"set_executable({path!r}) names an interpreter on this machine, but the "
                f"{backend.name} backend's jobs run elsewhere; set the interpreter they run "
                "with init(python=...) or FIBER_PYTHON")
        config.init(python=path)

    def set_forkserver_preload(self, module_names: list[str]) -> None:
        """Modules the local backend's template process imports before it forks workers
        (its ``preload`` setting); other backends start fresh interpreters and ignore it."""
        if not isinstance(module_names, list) or not all(isinstance(n, str) for n in module_names):
            raise TypeError("module_names must be a list of strings")
        config.init(local_preload=list(module_names))

    @property
    def reducer(self) -> Any:
        """:mod:`multiprocessing.reduction`: reducers registered there are used by Fiber too."""
        return multiprocessing.reduction

    @reducer.setter
    def reducer(self, reduction: Any) -> None:
        raise ValueError(
            "Fiber pickles with its own pickler and cannot take another reduction module; "
            "register a reducer for a type with multiprocessing.reduction.register(type, "
            "reduce_function) and Fiber uses it")

    def _check_available(self) -> None:
        # The stdlib's get_context(name) calls this on the context it found: for
        # get_context("fiber") it passes; for set_start_method("fiber") (which goes through
        # get_context) it refuses, since multiprocessing.Process and Queue would then use a
        # context they cannot work with.
        frame = sys._getframe(1)  # noqa: SLF001 - as above
        for _ in range(4):
            if frame.f_back is None:
                break
            frame = frame.f_back
            if (frame.f_code.co_name == "set_start_method"
                    and frame.f_globals.get("__name__") == "multiprocessing.context"):
                raise ValueError(
                    "multiprocessing.set_start_method('fiber') is not supported: the stdlib's "
                    "Process, Queue and Pool cannot start Fiber jobs. For a whole program use "
                    "`import fiber_core as multiprocessing`; for a library that takes a start "
                    "method name, pass it 'fiber' (AsyncVectorEnv(context='fiber'), "
                    "SubprocVecEnv(start_method='fiber')) after `import fiber_core`."
                )


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
    if method is None:
        _default.fix_start_method()  # as the stdlib's: the default context is now in use
    return _default if method in (None, "fiber") else FiberContext(method)
