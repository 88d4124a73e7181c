"""Fiber: the ``multiprocessing`` API, with every process a job on a pluggable backend.

``import fiber_core as multiprocessing`` is the whole port; ``FIBER_BACKEND=docker``
(or ``kubernetes``, ``ssh``, ``aws-batch``) moves the jobs off this machine. Importing
``fiber_core`` also makes ``"fiber"`` a start method name for libraries that take one
(``multiprocessing.get_context("fiber")``), and ``fiber_core.futures`` has the
:mod:`concurrent.futures` executor.
"""

from __future__ import annotations

from fiber_core.parallel.start_method import register_start_method

TYPE_CHECKING = False  # typing's own, without importing typing: a job starts without it
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from typing import Any, TypeVar

    from fiber_core.base.errors import (
        AuthenticationError,
        BufferTooShort,
        ProcessError,
        TimeoutError,
    )
    from fiber_core.base.log import get_logger, log_to_stderr
    from fiber_core.base.options import Option
    from fiber_core.contract.backend import Backend, Job, JobSpec
    from fiber_core.contract.hookspecs import hookimpl
    from fiber_core.parallel.broadcast import Broadcast, broadcast
    from fiber_core.parallel.context import FiberContext, get_context
    from fiber_core.parallel.durable.task import Task, current_task
    from fiber_core.parallel.managers import AsyncManager, BaseManager, Manager, SyncManager  # noqa: F401 - what __getattr__ gives, named for type checkers
    from fiber_core.parallel.pool import Pool  # noqa: F401 - what __getattr__ gives, named for type checkers
    from fiber_core.parallel.queues import JoinableQueue, Queue, SimpleQueue
    from fiber_core.parallel.ring import Ring  # noqa: F401 - what __getattr__ gives, named for type checkers
    from fiber_core.parallel.sharedctypes import Array, RawArray, RawValue, Value
    from fiber_core.parallel.synchronize import (
        Barrier,
        BoundedSemaphore,
        Condition,
        Event,
        Lock,
        RLock,
        Semaphore,
    )
    from fiber_core.processes.pipe import Pipe
    from fiber_core.processes.process import (
        Process,
        active_children,
        cpu_count,
        current_process,
        parent_process,
    )
    from fiber_core.runtime.config import config  # noqa: F401 - what __getattr__ gives, named for type checkers
    from fiber_core.runtime.status import StatusServer

    F = TypeVar("F", bound=Callable[..., Any])

__version__ = "0.1.0"

# "fiber" becomes a start method name of the stdlib's multiprocessing.get_context, for
# libraries that take a name (gymnasium's AsyncVectorEnv(context="fiber")); the context
# behind it is imported when the name is first looked up.
register_start_method()


def init(**kwargs: Any) -> None:
    """Configure Fiber in code: ``init(backend="docker", docker_image="app:1")``.

    Values set here beat ``FIBER_*`` variables and ``.fiberconfig``. Keys are the
    global options (``fiber config`` lists them) and ``<backend>_<option>``.
    ``init(status=True)`` shows the program's state to ``fiber top``, ``status_port=``
    on a page too (see :func:`serve_status`).
    """
    from fiber_core.runtime.config import config

    config.init(**kwargs)
    if "status" in kwargs or "status_port" in kwargs:
        from fiber_core.runtime import run  # not as a name here: fiber_core.runtime is the package

        run.runtime().status_from_config()  # at once if the run is under way, else when it starts


def serve_status(page: bool = False, port: int = 0) -> StatusServer:
    """Show this program's state (pools, workers, tasks, losses, throughput) from now on.

    ``fiber top`` in another terminal of the same user then shows it; with ``page=True``,
    a web page on 127.0.0.1:``port`` (0: any free port) does too, at the address
    ``.url`` holds (also printed to stderr), whose token opens it. Nothing is shown
    unless this is called or the ``status``/``status_port`` settings ask, and only a
    holder of the run's key (or of the page's token) sees it. Calling it again returns
    the same server (adding the page if asked).
    """
    from fiber_core.runtime import run

    return run.runtime().serve_status(page, port)


def meta(*, cpu: float | None = None, memory: int | None = None, gpu: int | None = None,
         gpu_type: str | Sequence[str | tuple[str, int]] | None = None,
         capacity: str | None = None, env: Mapping[str, str] | None = None,
         env_pass: bool | None = None, env_exclude: Sequence[str] | None = None,
         secret_env: Sequence[str] | None = None) -> Callable[[F], F]:
    """Declare the resources a function needs when it runs as a job or pool task.

    ``memory`` is in MiB. ``gpu_type`` is one GPU type, or several in order of preference,
    each with its own count where they differ: ``["a100", "l40s"]``, ``[("a100", 1), ("l4", 2)]``
    ``capacity`` is ``"spot"``, ``"on-demand"`` or ``"spot-then-on-demand"``
    (``docs/placement.md``). The values reach the backend's :class:`JobSpec` for a
    ``Process(target=f)`` and for the workers of a ``Pool`` built for ``f``.

    The job's environment: the program's environment reaches it (docs/guarantees.md says
    what stays behind); ``env`` adds variables (names to strings), ``env_pass=False`` passes
    none of the program's, ``env_exclude`` leaves out names or patterns (``"MY_*"``), and
    ``secret_env`` names variables passed the way the run's key is, never in what others can
    list. They add to the backend's settings of the same names (``extra_env`` for ``env``).
    """
    from fiber_core.contract.env import check_job_env  # the API stays light to import

    env_choices = check_job_env({"env": env, "env_pass": env_pass, "env_exclude": env_exclude,
                                 "secret_env": secret_env}, "meta")
    for key, value, kind in (("cpu", cpu, (int, float)), ("memory", memory, int), ("gpu", gpu, int)):
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool) or value < 0):
            raise ValueError(f"meta({key}={value!r}): expected a non-negative number")
    if gpu_type is not None or capacity is not None:
        from fiber_core.contract.placement import (  # only a function that names them loads it
            capacity_kinds,
            gpu_choices,
        )

        gpu_choices(gpu_type, gpu)  # a malformed list fails here, with what to write
        capacity_kinds(capacity)

    def decorate(func: F) -> F:
        func.__fiber_meta__ = {"cpu": cpu, "memory": memory, "gpu": gpu,  # type: ignore[attr-defined]
                               "gpu_type": gpu_type, "capacity": capacity, **env_choices}
        return func

    return decorate


_LAZY = {
    **dict.fromkeys(("AuthenticationError", "BufferTooShort", "ProcessError", "TimeoutError"),
                    "fiber_core.base.errors"),
    **dict.fromkeys(("get_logger", "log_to_stderr"), "fiber_core.base.log"),
    "Option": "fiber_core.base.options",
    **dict.fromkeys(("Backend", "Job", "JobSpec"), "fiber_core.contract.backend"),
    "hookimpl": "fiber_core.contract.hookspecs",
    **dict.fromkeys(("broadcast", "Broadcast"), "fiber_core.parallel.broadcast"),
    **dict.fromkeys(("FiberContext", "get_context"), "fiber_core.parallel.context"),
    **dict.fromkeys(("Task", "current_task"), "fiber_core.parallel.durable.task"),
    **dict.fromkeys(("Manager", "SyncManager", "BaseManager", "AsyncManager"), "fiber_core.parallel.managers"),
    "Pool": "fiber_core.parallel.pool",
    **dict.fromkeys(("JoinableQueue", "Queue", "SimpleQueue"), "fiber_core.parallel.queues"),
    "Ring": "fiber_core.parallel.ring",
    **dict.fromkeys(("Array", "RawArray", "RawValue", "Value"), "fiber_core.parallel.sharedctypes"),
    **dict.fromkeys(("Barrier", "BoundedSemaphore", "Condition", "Event", "Lock", "RLock", "Semaphore"),
                    "fiber_core.parallel.synchronize"),
    "Pipe": "fiber_core.processes.pipe",
    **dict.fromkeys(("Process", "active_children", "cpu_count", "current_process", "parent_process"),
                    "fiber_core.processes.process"),
    "config": "fiber_core.runtime.config",
}
"""Where each name of the API lives: imported on its first use, so that ``import fiber_core``
(and with it the start of every job) loads only what a job needs."""

_CONTEXT = frozenset({"allow_connection_pickling", "reducer", "set_executable", "set_forkserver_preload"})
"""Names the module takes from its default context, as the stdlib's does."""

_SUBMODULES = frozenset({"connection", "context", "futures", "heap", "managers", "pool", "process",
                         "queues", "sharedctypes", "synchronize"})


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is not None:
        import importlib  # a name's first use

        value = getattr(importlib.import_module(where), name)
        globals()[name] = value  # found directly from now on
        return value
    if name in _CONTEXT:
        return getattr(_default_context(), name)
    if name in _SUBMODULES:  # `fiber_core.managers` without its own import
        import importlib

        return importlib.import_module(f"fiber_core.{name}")
    raise AttributeError(f"module 'fiber_core' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_CONTEXT})


def _default_context() -> FiberContext:
    from fiber_core.parallel.context import _default  # a name's first use

    return _default


def set_start_method(method: str | None, force: bool = False) -> None:
    _default_context().set_start_method(method, force)


def get_start_method(allow_none: bool = False) -> str | None:
    return _default_context()._default_start_method(allow_none)  # noqa: SLF001 - the stdlib context's own choice of default, which it keeps private


def get_all_start_methods() -> list[str]:
    return _default_context().get_all_start_methods()


def freeze_support() -> None:
    pass


__all__ = [
    "Array", "AuthenticationError", "Backend", "Barrier", "Broadcast", "BoundedSemaphore", "BufferTooShort",
    "Condition", "Event", "FiberContext", "Job", "JobSpec", "JoinableQueue", "Lock", "Manager", "Option",
    "Pipe", "Pool", "Process", "ProcessError", "Queue", "RLock", "RawArray", "RawValue", "Semaphore",
    "SimpleQueue", "Value",
    "TimeoutError", "active_children", "allow_connection_pickling", "broadcast", "cpu_count", "current_process", "current_task", "Task", "freeze_support",
    "get_all_start_methods", "get_context", "get_logger", "get_start_method", "hookimpl", "init",
    "log_to_stderr", "meta", "parent_process", "reducer", "set_executable",
    "serve_status", "set_forkserver_preload", "set_start_method",
]
