"""``Pool``: the :class:`multiprocessing.pool.Pool` API over job-backed workers, as a package of parts.

Every worker is a daemonic :class:`~fiber_core.processes.process.Process` (a job on
the selected backend) that connects back to the pool's master thread and *pulls*
work: it asks for a batch when it is ready, so a slow or late worker never holds up
the others. The master keeps a table of what each worker holds; when a worker dies,
its batches go back to the front of the queue and a replacement starts; a result is
accepted once per task, so every result reaches the caller exactly once, in order
for ``map``.

The parts (each imports only those above it in this list):

* :mod:`.worker`: the worker side, all a worker's process loads of the pool;
* :mod:`.ledger`: what a lost worker costs whom (pure);
* :mod:`.planner`: units and batch sizes (pure);
* :mod:`.results`: ``AsyncResult``, ``MapResult``, the ``imap`` iterators;
* :mod:`.table`: the workers and the queue, starting, retiring and failing workers;
* :mod:`.dispatch`: which worker gets which units;
* :mod:`.events`: what workers send, and their deaths;
* :mod:`.master`: the master thread's loop, deadlines, the live view;
* :mod:`.facade`: ``Pool``, the stdlib's API and the lifecycle.

Extensions to the stdlib API: :meth:`Pool.resize` grows or shrinks a running pool;
``close()`` on an ``imap`` iterator and ``cancel()`` on a result cancel a call;
``retries=``, ``task_losses=``, ``loss_limit=``, ``backup=``, ``deadline=``,
``min_processes=`` (see docs/guarantees.md).
"""

from __future__ import annotations

import importlib

from fiber_core.parallel.pool.worker import MaybeEncodingError

TYPE_CHECKING = False  # typing's own, without importing typing: a job starts without it
if TYPE_CHECKING:
    from typing import Any

    from fiber_core.parallel.pool.facade import Pool
    from fiber_core.parallel.pool.ledger import MAX_TASK_ATTEMPTS
    from fiber_core.parallel.pool.results import (
        ApplyResult,
        AsyncResult,
        IMapIterator,
        IMapUnorderedIterator,
        MapResult,
        RemoteTraceback,
    )

_LAZY = {"MAX_TASK_ATTEMPTS": "ledger", "Pool": "facade", "ApplyResult": "results", "AsyncResult": "results", "MapResult": "results",
         "IMapIterator": "results", "IMapUnorderedIterator": "results", "RemoteTraceback": "results"}


def __getattr__(name: str) -> Any:
    # A pool worker imports this package only for its worker module: the master's
    # modules load on first use of their names, never in a worker.
    part = _LAZY.get(name)
    if part is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{part}"), name)
    globals()[name] = value
    return value


__all__ = ["MAX_TASK_ATTEMPTS", "ApplyResult", "AsyncResult", "IMapIterator", "IMapUnorderedIterator",
           "MapResult", "MaybeEncodingError", "Pool", "RemoteTraceback"]
