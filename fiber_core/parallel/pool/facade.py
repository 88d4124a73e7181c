"""``Pool``: the :class:`multiprocessing.pool.Pool` API over job-backed workers, and its lifecycle.

The facade checks its arguments, pickles each call's units in the caller's thread
and queues them (:meth:`Pool._submit`), and closes, terminates and joins. The rest is
the master's (:mod:`~fiber_core.parallel.pool.master`).
"""

from __future__ import annotations

import itertools
import queue as _queue
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from fiber_core.base.errors import FiberError
from fiber_core.base.log import log
from fiber_core.parallel.durable import journal as durable
from fiber_core.parallel.pool import notebook, planner
from fiber_core.parallel.pool import roles as role_table
from fiber_core.parallel.pool.budget import CostCap
from fiber_core.parallel.pool.dispatch import BACKUP_FACTOR
from fiber_core.parallel.pool.ledger import MAX_TASK_ATTEMPTS
from fiber_core.parallel.pool.on_demand import (
    OnDemandFallback,
    on_demand_after_of,
    on_demand_keywords,
    pool_capacity,
)
from fiber_core.parallel.pool.results import (
    ApplyResult,
    IMapIterator,
    IMapUnorderedIterator,
    MapResult,
    call_name,
    check_deadline,
    check_retries,
)
from fiber_core.parallel.pool.table import IDLE_TIMEOUT, Unit
from fiber_core.parallel.pool.worker import APPLY, MAP, STARMAP
from fiber_core.processes.process import Process, cpu_count
from fiber_core.runtime import status
from fiber_core.runtime.run import runtime, sending_to
from fiber_core.wire.serialize import dumps


def _sizes(processes: int | None, min_processes: int | None, idle_timeout: float) -> tuple[int, int]:
    """The pool's size and minimum, checked (the size defaults to the CPUs, the minimum to the size)."""
    if processes is None:
        processes = cpu_count()
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
        raise ValueError("Number of processes must be at least 1")
    if min_processes is None:
        min_processes = processes
    if (not isinstance(min_processes, int) or isinstance(min_processes, bool)
            or not 0 <= min_processes <= processes):
        raise ValueError(f"min_processes must be an int from 0 to processes ({processes}), "
                         f"not {min_processes!r}")
    if isinstance(idle_timeout, bool) or not isinstance(idle_timeout, (int, float)) or not idle_timeout > 0:
        raise ValueError(f"idle_timeout must be a number of seconds above 0, not {idle_timeout!r}")
    return processes, min_processes


def _task_losses(task_losses: int) -> int:
    if not isinstance(task_losses, int) or isinstance(task_losses, bool) or task_losses < 1:
        raise ValueError(f"task_losses must be an int of 1 or more, not {task_losses!r}")
    return task_losses


def _loss_limit(loss_limit: tuple[int, float] | None) -> tuple[int, float] | None:
    if loss_limit is not None:
        try:
            count, window = loss_limit
            ok = isinstance(count, int) and count >= 1 and float(window) > 0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"loss_limit must be (losses, seconds), such as (100, 600.0); "
                             f"not {loss_limit!r}")
    return loss_limit


def _backup(backup: bool | float | None) -> float | None:
    """The backup factor (``True``: :data:`~fiber_core.parallel.pool.dispatch.BACKUP_FACTOR`), or None."""
    if backup is True:
        return BACKUP_FACTOR
    if backup is False or backup is None:
        return None
    if isinstance(backup, (int, float)) and backup > 1:
        return float(backup)
    raise ValueError(f"backup must be True, False or a factor over 1 (such as 3.0), not {backup!r}")


class Pool(OnDemandFallback):
    """A pool of job-backed workers with the API of :class:`multiprocessing.pool.Pool`.

    Fiber adds keyword-only arguments: ``backend`` (a backend for the workers),
    resources ``cpu``, ``memory`` (MiB), ``gpu``, ``gpu_type`` and ``image``
    for each worker's job (defaulting to what :func:`fiber_core.meta` put on the
    ``initializer``, then to configuration), and :meth:`resize`. How lost workers
    are charged: ``retries`` (runs again of a task that raised; default 0, also per
    call), ``task_losses`` (worker deaths a task may cause before it fails; an
    out-of-memory kill fails it at once), ``loss_limit`` (``(losses, seconds)``: workers
    lost to no task's fault before the pool fails; default ``(max(100, 10 *
    processes), 600)``).

    **Elastic pools.** With ``min_processes`` below ``processes``, the pool keeps at
    least ``min_processes`` workers and asks for more, up to ``processes``, while work
    waits in its queue; a worker beyond the minimum that stays idle for
    ``idle_timeout`` seconds (default 60) goes. A worker asked for is a request: one
    the platform has not granted yet (a pending pod, a RUNNABLE Batch job) takes no
    work until it runs, and tasks never wait for the pool to reach any size. A worker
    that the platform never starts (``NEVER_STARTED``) while others run is a request
    declined, not a failure: the pool asks again later. ``Pool(64, min_processes=4)``
    reads "up to 64 workers, at least 4"; ``min_processes=0`` keeps none while idle.

    **Roles** (mixed pools). ``roles`` names further sets of workers with sizes and
    resources of their own: ``Pool(64, roles={"learner": {"processes": 1, "gpu": 1}})``.
    A call goes to a role when it says so (``role="learner"`` on every call method) or
    when its function asks through :func:`fiber_core.meta` for resources only a role
    has; other calls run on the default workers. A role takes the Pool's own keywords
    (size, ``min_processes``, budgets, ``backend``, resources; the initializer and
    backend are the pool's unless it names its own), and its workers are named
    ``PoolWorker-<role>-N``. ``close``, ``terminate`` and ``join`` act on every role;
    ``resize(n, role=...)`` resizes one.

    **A cost cap.** With ``max_hourly_cost`` (or the setting of that name), the pool runs
    no more workers than fit under it by the ``prices`` setting, each counted at the
    dearest of its GPU alternatives and capacity kinds, and says once, with the numbers,
    when that is fewer than asked; :meth:`set_max_hourly_cost` raises or lowers it, and
    the pool grows or shrinks to match (``docs/placement.md``).

    **Spot, then on-demand.** With ``capacity="spot-then-on-demand"``, a task whose workers
    were preempted ``on_demand_after`` times (default 2, or the setting of that name) runs its
    next attempt on on-demand workers the pool makes when first needed, elastic from none
    (:mod:`~fiber_core.parallel.pool.on_demand`).
    """

    _on_demand: Pool | None

    def __init__(self, processes: int | None = None, initializer: Callable | None = None,
                 initargs: tuple = (), maxtasksperchild: int | None = None, context: Any = None,
                 *, backend: str | None = None, retries: int = 0,
                 task_losses: int = MAX_TASK_ATTEMPTS,
                 loss_limit: tuple[int, float] | None = None, backup: bool | float = False,
                 min_processes: int | None = None, idle_timeout: float = IDLE_TIMEOUT,
                 roles: Mapping[str, Any] | None = None, _role: str | None = None,
                 max_hourly_cost: float | None = None, on_demand_after: int | None = None,
                 **resources: Any) -> None:
        processes, min_processes = _sizes(processes, min_processes, idle_timeout)
        after = on_demand_after_of(on_demand_after, pool_capacity(resources, initializer))
        if after is not None:  # what its on-demand workers are made with, when first needed
            self._keywords = dict(processes=processes, initializer=initializer, initargs=initargs,
                                  maxtasksperchild=maxtasksperchild, backend=backend, retries=retries,
                                  task_losses=task_losses, loss_limit=loss_limit, backup=backup,
                                  idle_timeout=idle_timeout, max_hourly_cost=max_hourly_cost, **resources)
        role_specs = role_table.parse_roles(roles)
        self._budget = CostCap(processes, max_hourly_cost, initializer, resources)
        processes = self._budget.fit(processes)
        min_processes = min(min_processes, processes)
        if maxtasksperchild is not None and (
                not isinstance(maxtasksperchild, int) or maxtasksperchild <= 0):
            raise ValueError("maxtasksperchild must be a positive int or None")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        super().__init__(processes=processes, min_processes=min_processes, idle_timeout=idle_timeout,
                         initializer=initializer, initargs=initargs, maxtasks=maxtasksperchild,
                         backend=backend, retries=check_retries(retries),
                         task_losses=_task_losses(task_losses), loss_limit=_loss_limit(loss_limit),
                         backup=_backup(backup), resources=resources)
        self._roles: dict[str, Pool] = {}
        self._on_demand_after, self._role = after, _role
        if _role is not None:
            self._worker_name = f"PoolWorker-{_role}"
        self._status_asks = []
        hub = runtime().hub
        hub.register(f"pool:{self._id}", self._on_connect)
        try:
            with self._lock:
                self._top_up()
                self._started = True
        except BaseException:
            self._state = "TERMINATE"
            for w in self._workers.values():
                w.process.kill()
            hub.unregister(f"pool:{self._id}")
            raise
        self._thread = threading.Thread(target=self._master, daemon=True, name="fiber-pool-master")
        self._thread.start()
        status.report(self)
        if role_specs:
            self._start_roles(role_specs, {"initializer": initializer, "initargs": initargs,
                                           "backend": backend})

    def _start_roles(self, specs: dict[str, dict[str, Any]], inherited: dict[str, Any]) -> None:
        """A Pool per role (see the class's docstring); on a failure none stays, this one neither."""
        try:
            for name, spec in specs.items():
                self._roles[name] = Pool(**{**inherited, **spec}, _role=name)
        except BaseException:
            self.terminate()
            raise

    def _new_on_demand_pool(self) -> Pool:
        return Pool(**on_demand_keywords(self._keywords),
                    _role=f"{self._role}-on-demand" if self._role else "on-demand")

    def _pool_for(self, func: Callable, role: str | None) -> Pool:
        """The pool (this one or a role's) that runs a call of ``func``."""
        if not self._roles and role is None:
            return self
        offered = {role_table.DEFAULT: self.worker_resources,
                   **{name: pool.worker_resources for name, pool in self._roles.items()}}
        name = role_table.route(role, getattr(func, "__fiber_meta__", None), offered)
        return self if name == role_table.DEFAULT else self._roles[name]

    def _check_running(self) -> None:
        if self._error is not None:
            raise self._error
        if self._state != "RUN":
            raise ValueError("Pool not running")

    def _submit(self, call: Any, func: Callable, kind: int, chunks: Iterable[Sequence[Any]],
                func_bytes: bytes | None = None, retries: int | None = None,
                whole: Callable[[], bytes] | None = None) -> int:
        """Pickle every unit now (so a bad argument fails here), then queue them (those the
        journal does not hold: ``whole`` gives the call's whole input pickled, if not its unit)."""
        notebook.follow_cell(self)  # (in a notebook only: its progress in the cell)
        chunks = list(chunks)
        retries = self._retries if retries is None else check_retries(retries)
        with sending_to(self._hub):
            if func_bytes is None:
                func_bytes = dumps(func)
            units = []
            start = 0
            for i, (chunk, data) in enumerate(zip(chunks, map(dumps, chunks))):
                units.append(Unit(call, i, data, call.call_id, func_bytes, kind, len(chunk),
                                   start, retries))
                start += len(chunk)
        replayed = self._begin_call(call, func, func_bytes, units, whole or (lambda: units[0].data))
        with self._lock:
            self._check_running()
            self._calls[call.call_id] = call
            for index, values in replayed:  # (none is queued yet: the master cannot deliver one)
                call.set_unit(index, True, values)
            self._queue.extend(units)
            # Hand out the first batches from this thread: one wake-up less on the way.
            try:
                self._dispatch()
            except Exception:
                log.exception("fiber: dispatching from the caller failed; the master will")
            left = bool(self._queue)
        if left:
            self._wake()
        return len(units)

    @staticmethod
    def _begin_call(call: Any, func: Callable, func_bytes: bytes, units: list[Unit],
                    whole: Callable[[], bytes]) -> list[tuple[int, Any]]:
        """Give the call its place in the program's calls (``call.durable``) and take out of
        ``units`` those whose results the journal holds: returned as ``(index, values)``."""
        key = call.durable = durable.program().begin(call.call_name, func, func_bytes, whole)
        if key.journal is None or (key.checked and not key.replayed):
            return []
        replayed, kept = [], []
        for unit in units:
            recorded, values = key.take(unit.index, unit.data)
            if recorded:
                replayed.append((unit.index, values))
            else:
                kept.append(unit)
        units[:] = kept
        return replayed

    def apply_async(self, func: Callable, args: tuple = (), kwds: dict | None = None,
                    callback: Callable | None = None, error_callback: Callable | None = None,
                    *, retries: int | None = None, deadline: float | None = None,
                    role: str | None = None) -> ApplyResult:
        self._check_running()
        target = self._pool_for(func, role)
        if target is not self:
            return target.apply_async(func, args, kwds, callback, error_callback, retries=retries,
                                      deadline=deadline)
        check_deadline(deadline)
        # (an error adds the arguments, from the unit, if needed)
        result = ApplyResult(self, callback, error_callback, call_name("apply_async", func))
        self._submit(result, func, APPLY, [[(tuple(args), dict(kwds or {}))]], retries=retries)
        self._set_deadline(result, deadline)
        return result

    def apply(self, func: Callable, args: tuple = (), kwds: dict | None = None,
              *, retries: int | None = None, deadline: float | None = None,
              role: str | None = None) -> Any:
        return self.apply_async(func, args, kwds, retries=retries, deadline=deadline, role=role).get()

    def _map_async(self, func: Callable, iterable: Iterable, kind: int, chunksize: int | None,
                   callback: Callable | None, error_callback: Callable | None,
                   retries: int | None = None, deadline: float | None = None,
                   role: str | None = None) -> MapResult:
        self._check_running()
        target = self._pool_for(func, role)
        if target is not self:
            submit = target.starmap_async if kind == STARMAP else target.map_async
            return submit(func, iterable, chunksize, callback, error_callback, retries=retries,
                          deadline=deadline)
        check_deadline(deadline)
        # A sequence is sliced as it is (a range into ranges): no copy of its items here.
        items = iterable if isinstance(iterable, (list, tuple, range)) else list(iterable)
        with sending_to(self._hub):
            func_bytes = dumps(func)
        if chunksize is None:
            # Units fine enough to balance, coarse enough to be cheap (the planner's rule); with
            # a journal, cut the same way in every run (no measured time) for its units to match.
            nunits = planner.auto_units(self._processes, len(items), None if durable.program().journalled
                                        else self._item_seconds.get(hash(func_bytes)))
            bounds = planner.unit_bounds(len(items), nunits)
            chunks = [items[a:b] for a, b in zip(bounds, bounds[1:])]
        elif chunksize < 1:
            raise ValueError(f"Chunksize must be 1+, not {chunksize}")
        else:
            chunks = [items[i:i + chunksize] for i in range(0, len(items), chunksize)]
        result = MapResult(self, len(chunks), callback, error_callback,
                           call_name("starmap" if kind == STARMAP else "map", func),
                           [len(c) for c in chunks] if deadline is not None else None)
        if chunks:
            # (the identity covers the input and its cut into units: units are matched by index)
            self._submit(result, func, kind, chunks, func_bytes, retries,
                         lambda: durable.args_bytes((kind, chunksize, len(chunks), items)))
            self._set_deadline(result, deadline)
        return result

    def map_async(self, func: Callable, iterable: Iterable, chunksize: int | None = None,
                  callback: Callable | None = None, error_callback: Callable | None = None,
                  *, retries: int | None = None, deadline: float | None = None,
                  role: str | None = None) -> MapResult:
        return self._map_async(func, iterable, MAP, chunksize, callback, error_callback, retries,
                               deadline, role)

    def map(self, func: Callable, iterable: Iterable, chunksize: int | None = None,
            *, retries: int | None = None, deadline: float | None = None,
            role: str | None = None) -> list:
        return self._map_async(func, iterable, MAP, chunksize, None, None, retries, deadline,
                               role).get()

    def starmap_async(self, func: Callable, iterable: Iterable, chunksize: int | None = None,
                      callback: Callable | None = None, error_callback: Callable | None = None,
                      *, retries: int | None = None, deadline: float | None = None,
                      role: str | None = None) -> MapResult:
        return self._map_async(func, iterable, STARMAP, chunksize, callback, error_callback, retries,
                               deadline, role)

    def starmap(self, func: Callable, iterable: Iterable, chunksize: int | None = None,
                *, retries: int | None = None, deadline: float | None = None,
                role: str | None = None) -> list:
        return self._map_async(func, iterable, STARMAP, chunksize, None, None, retries,
                               deadline, role).get()

    def _imap(self, cls: type, func: Callable, iterable: Iterable, chunksize: int,
              retries: int | None = None, deadline: float | None = None,
              role: str | None = None) -> IMapIterator:
        self._check_running()
        target = self._pool_for(func, role)
        if target is not self:
            submit = target.imap_unordered if cls is IMapUnorderedIterator else target.imap
            return submit(func, iterable, chunksize, retries=retries, deadline=deadline)
        check_deadline(deadline)
        if chunksize < 1:
            raise ValueError(f"Chunksize must be 1+, not {chunksize}")
        retries = self._retries if retries is None else check_retries(retries)
        with sending_to(self._hub):
            func_bytes = dumps(func)  # an unpicklable function fails here, in the caller
        it = cls(self, call_name("imap_unordered" if cls is IMapUnorderedIterator else "imap", func))
        notebook.follow_cell(self)  # (in a notebook only: its progress in the cell)
        key = it.durable = durable.program().begin(it.call_name, func, func_bytes, None)
        with self._lock:
            self._check_running()  # again: the pool may have failed while func was pickled
            self._calls[it.call_id] = it

        def feed() -> None:
            n = 0
            try:
                source = iter(iterable)
                while True:
                    chunk = list(itertools.islice(source, chunksize))
                    if not chunk:
                        break
                    with sending_to(self._hub):
                        data = dumps(chunk)
                    recorded, values = key.take(n, data)
                    if recorded:  # the journal holds its result
                        it.set_unit(n, True, values)
                        n += 1
                        continue
                    unit = Unit(it, n, data, it.call_id, func_bytes, MAP, len(chunk),
                                 n * chunksize, retries)
                    with self._lock:
                        if self._state == "TERMINATE" or it._closed:
                            return
                        self._queue.append(unit)
                    n += 1
                    self._wake()
            except BaseException as e:
                # The input (or pickling an item of it) failed: that error is the result at
                # this position, after the results of the items before it.
                it.set_unit(n, False, e)
                it._set_length(n + 1)
                return
            it._set_length(n)

        threading.Thread(target=feed, daemon=True, name="fiber-pool-feeder").start()
        self._set_deadline(it, deadline)
        return it

    def imap(self, func: Callable, iterable: Iterable, chunksize: int = 1,
             *, retries: int | None = None, deadline: float | None = None,
             role: str | None = None) -> IMapIterator:
        return self._imap(IMapIterator, func, iterable, chunksize, retries, deadline, role)

    def imap_unordered(self, func: Callable, iterable: Iterable, chunksize: int = 1,
                       *, retries: int | None = None, deadline: float | None = None,
                       role: str | None = None) -> IMapIterator:
        return self._imap(IMapUnorderedIterator, func, iterable, chunksize, retries, deadline, role)

    def resize(self, processes: int, *, role: str | None = None) -> None:
        """Grow or shrink the pool (or its ``role``) to ``processes`` workers (Fiber extension).

        Growing starts new jobs at once (local ones one per CPU at a time, as at
        start). Shrinking retires idle workers first and
        busy ones once their current batch is done; no task is lost. An elastic
        pool's maximum becomes ``processes`` (its minimum no more than that).
        """
        if role is not None:
            self._check_running()
            role_table.route(role, None, {role_table.DEFAULT: {}, **dict.fromkeys(self._roles, {})})
            self._roles[role].resize(processes)
            return
        if not isinstance(processes, int) or processes < 1:
            raise ValueError("Number of processes must be at least 1")
        processes = self._budget.fit(processes)  # what the cost cap allows
        with self._lock:
            self._check_running()
            if self._min == self._processes:
                self._min = processes
            self._processes = processes
            self._min = min(self._min, processes)
            active = [w for w in self._workers.values() if not w.retiring and not w.lost]
            self._top_up()
            extra = len(active) - processes
            for w in sorted(active, key=lambda w: (len(w.pending), not w.ready))[:max(0, extra)]:
                self._retire(w)
        self._wake()

    def _cost_per_hour(self, workers: int) -> float | None:
        return self._budget.cost_per_hour(workers)

    def set_max_hourly_cost(self, cap: float | None) -> None:
        """Change the cost cap (Fiber extension; ``None``: none): the pool grows toward the
        size it was given as far as the new cap allows, or shrinks to fit it."""
        with self._lock:
            self._check_running()
            wanted = self._budget.wanted
            self._budget.change(cap)
        self.resize(wanted)

    def close(self) -> None:
        """No more work will be submitted; workers exit once the queued work is done."""
        with self._lock:
            if self._state == "RUN":
                self._state = "CLOSE"
        self._wake()
        for pool in self._roles.values():
            pool.close()

    def terminate(self) -> None:
        """Stop every worker now. Unfinished results raise instead of hanging."""
        for pool in self._roles.values():
            pool.terminate()
        with self._lock:
            ended = self._state == "TERMINATE" and self._done.is_set()
            if not ended:
                self._state = "TERMINATE"
                self._kill_workers()
                self._fail_all_locked(self._error or FiberError("pool was terminated"))
        if self._on_demand is not None:  # (read once this pool is TERMINATE: none is made after)
            self._on_demand.terminate()
        if not ended:
            self._wake()
            self._wait_done()

    def join(self) -> None:
        """Wait for the workers to exit; call :meth:`close` or :meth:`terminate` first."""
        if self._state == "RUN":
            raise ValueError("Pool is still running")
        self._wait_done()
        for pool in self._roles.values():
            pool.join()
        if self._on_demand is not None:  # (it ran tasks of this pool's calls: all are done now)
            self._on_demand.close()
            self._on_demand.join()

    def _wait_done(self) -> None:
        if threading.current_thread() is self._thread:
            return  # called from a callback, in the master: it ends once the callback returns
        self._done.wait()
        for w in list(self._workers.values()):
            w.process.join()
        runtime().hub.unregister(f"pool:{self._id}")
        status.forget(self)
        self._release()

    def _release(self) -> None:
        """Free the descriptors the master left: no cyclic garbage collection needed."""
        with self._lock:
            self._wake_w.close()  # a later _wake fails quietly
            while True:  # connections of workers that came after the master ended
                try:
                    _, sock = self._incoming.get_nowait()
                except _queue.Empty:
                    break
                sock.close()
            for w in self._workers.values():
                if w.conn is not None:
                    w.conn.close()

    def __enter__(self) -> Pool:
        self._check_running()
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate()

    def __reduce__(self) -> None:  # type: ignore[override]
        raise NotImplementedError(
            "pool objects cannot be passed between processes or pickled")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} state={self._state} pool_size={self._processes}>"

    @property
    def worker_resources(self) -> dict[str, Any]:
        """What each worker's job asks for (Fiber extension): ``cpu``, ``memory``, ``gpu``,
        ``gpu_type``, ``image``, from the pool's keywords and the initializer's ``meta``."""
        return dict(self._resources)

    @property
    def _pool(self) -> list[Process]:
        """The worker processes (the stdlib attribute some programs read)."""
        with self._lock:
            mine = [w.process for w in self._workers.values()]
        # (each role's workers too: the stdlib's name for them, read through the same property)
        inner = [*self._roles.values(), *filter(None, [self._on_demand])]
        return mine + [p for pool in inner for p in pool._pool]  # noqa: SLF001 - the stdlib's name
