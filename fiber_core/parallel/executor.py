"""``ProcessPoolExecutor``: the :mod:`concurrent.futures` executor over a Fiber :class:`Pool`.

How the executor works
----------------------
``submit`` and ``map`` return real :class:`concurrent.futures.Future` objects, so
``as_completed``, ``wait`` and done-callbacks work as with the stdlib. Calls wait in the
executor's own queue and a feeder thread hands them to the pool, at most
:data:`QUEUED_PER_WORKER` per worker at a time (the stdlib hands ``max_workers + 1`` to its
call queue). A call handed over is *running*: ``Future.cancel()`` fails on it, as in the
stdlib; a call still queued can be cancelled, and ``shutdown(cancel_futures=True)`` cancels
them all. The pool is created by the first ``submit``, so an executor that is never used
starts no job. Results, exceptions and the futures' done-callbacks come from the pool's
master thread. A task that raises sets its exception on the future with the remote
traceback as ``__cause__``, as the stdlib does. ``map`` sends each chunk of ``chunksize``
calls as one pool task, and ``max_tasks_per_child`` counts such tasks, as the stdlib does.

When the executor is broken
---------------------------
The stdlib reports :class:`~concurrent.futures.process.BrokenProcessPool` when any worker
process ends abruptly, whatever the reason, and the executor cannot be used any more.
Fiber's pool puts the tasks of a worker it lost (killed from outside, out of memory,
preempted, its host gone) back in its queue and starts a replacement: such a loss is no
error here, the tasks complete. Fiber reports ``BrokenProcessPool`` where the fault is the
program's, and then as the stdlib does (every pending future fails with it, ``submit``
raises it, its ``__cause__`` is the Fiber error that says what happened):

* a task that kills its worker (it exits, crashes, is killed) every time it runs. A first
  death cannot be told apart from a worker lost to the infrastructure, so the task runs
  once more than :data:`~fiber_core.parallel.pool.MAX_TASK_ATTEMPTS` (its first death, in
  a batch that does not say which task started, is charged to none; a SIGKILL the platform
  says was not an out-of-memory kill counts toward ``MAX_TASK_KILLS`` instead) where the
  stdlib runs it once; the cause is a :class:`~fiber_core.base.errors.TaskLostError`;
* workers that die before they are ready, as with a failing ``initializer`` or a bad image:
  the pool gives up after a few in a row; the cause is a
  :class:`~fiber_core.base.errors.JobStartError` with the worker's exit code and log.
"""

from __future__ import annotations

import atexit
import collections
import functools
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, InvalidStateError
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from fiber_core.base.errors import FiberError, JobStartError, PicklingError, TaskLostError
from fiber_core.base.log import log
from fiber_core.parallel.context import FiberContext
from fiber_core.parallel.pool import Pool
from fiber_core.processes.process import cpu_count

QUEUED_PER_WORKER = 2
"""Calls handed to the pool at once, per worker: enough for each worker to hold the next
call while it runs one (so a worker never waits for a round trip), few enough that the
rest stay cancellable."""


_BROKEN_FUTURE = ("A process in the process pool was terminated abruptly while the future "
                  "was running or pending.")


_BROKEN_POOL = "A child process terminated abruptly, the process pool is not usable anymore"


_callbacks = threading.local()  # set while futures are settled (and their callbacks run)


class _Call:
    __slots__ = ("future", "fn", "args", "kwargs", "chunk")

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, chunk: list | None = None) -> None:
        self.future: Future = Future()
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.chunk = chunk  # map: a list of argument tuples, run as one task


def _settle(future: Future, ok: bool, value: Any) -> None:
    outer = getattr(_callbacks, "active", False)
    _callbacks.active = True
    try:
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)
    except InvalidStateError:
        pass  # already failed by a break
    finally:
        _callbacks.active = outer


def _broken(cause: BaseException, message: str = _BROKEN_FUTURE) -> BrokenProcessPool:
    err = BrokenProcessPool(message)
    err.__cause__ = cause
    return err


class _Dispatcher:
    """The executor's queue, its feeder thread and its pool.

    The executor object only holds it, and the thread holds only this: so an executor
    that is dropped without ``shutdown()`` is collected, and then its calls finish and
    its pool closes, as with the stdlib.
    """

    def __init__(self, processes: int, pool_args: tuple, pool_kwargs: dict) -> None:
        self.processes = processes
        self.pool_args = pool_args
        self.pool_kwargs = pool_kwargs
        self.cond = threading.Condition()
        self.queue: collections.deque[_Call] = collections.deque()
        self.running: dict[int, _Call] = {}  # handed to the pool (or about to be), by id
        self.pool: Pool | None = None
        self.thread: threading.Thread | None = None
        self.shutting_down = False
        self.broken: BaseException | None = None  # what broke it

    # -- the caller's side ------------------------------------------------------------

    def submit(self, call: _Call) -> Future:
        with self.cond:
            if self.broken is not None:
                raise _broken(self.broken, _BROKEN_POOL)
            if self.shutting_down:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if _interpreter_exiting:
                raise RuntimeError("cannot schedule new futures after interpreter shutdown")
            if self.pool is None:
                # Bad configuration (an unknown backend, a missing image) fails here.
                self.pool = Pool(self.processes, *self.pool_args, **self.pool_kwargs)
                self.thread = threading.Thread(target=self._feed, daemon=True,
                                               name="fiber-executor-feeder")
                self.thread.start()
                _dispatchers.add(self)
            self.queue.append(call)
            self.cond.notify()
        return call.future

    def busy(self) -> bool:
        with self.cond:
            return bool(self.queue or self.running)

    def shutdown(self, wait: bool, cancel_futures: bool) -> None:
        with self.cond:
            self.shutting_down = True
            cancelled = list(self.queue) if cancel_futures else []
            if cancel_futures:
                self.queue.clear()
            thread = self.thread
            self.cond.notify_all()
        for call in cancelled:
            call.future.cancel()
        # From a done-callback (the pool's master thread) waiting would wait for itself.
        if wait and thread is not None and not getattr(_callbacks, "active", False):
            thread.join()

    def stop_workers(self, how: str) -> None:
        """``terminate_workers()``/``kill_workers()``: no new call, the queued ones cancelled,
        the running ones broken; the feeder then ends the pool at once."""
        self.shutdown(wait=False, cancel_futures=True)
        with self.cond:
            started = self.pool is not None
        if started:
            self._break(FiberError(f"the executor's workers were stopped by {how}()"))

    # -- the feeder thread --------------------------------------------------------------

    def _feed(self) -> None:
        assert self.pool is not None
        pool = self.pool
        limit = QUEUED_PER_WORKER * self.processes
        while True:
            with self.cond:
                while self.broken is None and not (self.queue and len(self.running) < limit):
                    if self.shutting_down and not self.queue and not self.running:
                        break
                    self.cond.wait()
                if self.broken is not None or not self.queue:
                    break
                take = []
                while self.queue and len(self.running) < limit:
                    call = self.queue.popleft()
                    # Under the lock, so a break never finds a future half-way; this runs
                    # no callback (a cancelled future ran them in cancel()).
                    if call.future.set_running_or_notify_cancel():
                        self.running[id(call)] = call
                        take.append(call)
            for call in take:
                self._hand_over(pool, call)
        if self.broken is not None:
            pool.terminate()
        else:
            pool.close()
            pool.join()

    def _hand_over(self, pool: Pool, call: _Call) -> None:
        done = functools.partial(self._finish, call, True)
        failed = functools.partial(self._finish, call, False)
        try:
            if call.chunk is None:
                pool.apply_async(call.fn, call.args, call.kwargs, callback=done, error_callback=failed)
            else:
                pool.starmap_async(call.fn, call.chunk, len(call.chunk), callback=done,
                                   error_callback=failed)
        except PicklingError as e:  # this call's function or arguments: its own error
            self._finish(call, False, e)
        except Exception as e:  # the pool gave up (its workers cannot start) or failed
            self._break(e, call)

    # -- called by the pool's master thread ----------------------------------------------

    def _finish(self, call: _Call, ok: bool, value: Any) -> None:
        with self.cond:
            if self.running.pop(id(call), None) is None:
                return  # a break has failed it already
            self.cond.notify()
        if not ok and isinstance(value, (TaskLostError, JobStartError)):
            self._break(value, call)
        else:
            _settle(call.future, ok, value)

    def _break(self, cause: BaseException, call: _Call | None = None) -> None:
        """Fail every pending call with BrokenProcessPool; the feeder then ends the pool."""
        with self.cond:
            if self.broken is None:
                self.broken = cause
            calls = list(self.queue) + list(self.running.values())
            self.queue.clear()
            self.running.clear()
            self.cond.notify_all()
        if call is not None and call not in calls:
            calls.insert(0, call)
        for c in calls:
            _settle(c.future, False, _broken(cause))


_dispatchers: weakref.WeakSet[_Dispatcher] = weakref.WeakSet()


_interpreter_exiting = False


def _at_exit() -> None:
    # As the stdlib: at interpreter exit, the calls already submitted finish first.
    global _interpreter_exiting
    _interpreter_exiting = True
    busy = [d for d in list(_dispatchers) if d.busy()]
    if busy and not _can_start_threads():
        log.warning(
            "fiber: a ProcessPoolExecutor still had calls to run when the interpreter exited, and "
            "this Python (CPython 3.12.0 and 3.12.1 forbid new threads at exit) cannot start the "
            "threads that finish them: they may be lost. Call shutdown() (or use `with`) first.")
    for d in busy:
        d.shutdown(wait=True, cancel_futures=False)


def _can_start_threads() -> bool:
    try:
        t = threading.Thread(target=lambda: None, name="fiber-exit-probe")
        t.start()
    except RuntimeError:
        return False
    t.join()
    return True


# The hook concurrent.futures uses (3.9+): it runs before the interpreter joins its threads
# and before atexit, while the pool's jobs still run.
getattr(threading, "_register_atexit", atexit.register)(_at_exit)


def _chunks(iterables: tuple[Iterable, ...], chunksize: int) -> Iterator[list[tuple]]:
    it = zip(*iterables)
    while True:
        chunk = list(itertools.islice(it, chunksize))
        if not chunk:
            return
        yield chunk


def _result_or_cancel(future: Future, timeout: float | None = None) -> Any:
    try:
        try:
            return future.result(timeout)
        finally:
            future.cancel()
    finally:
        del future  # no reference cycle through a raised exception's frame


class ProcessPoolExecutor(Executor):
    """:class:`concurrent.futures.ProcessPoolExecutor` whose workers are Fiber jobs.

    The stdlib's constructor and methods: ``submit``, ``map`` (with ``timeout`` and
    ``chunksize``), ``shutdown(wait=True, *, cancel_futures=False)``, use as a context
    manager. ``mp_context`` may be ``None`` or a Fiber context (``fiber_core.get_context()``);
    the workers always run on Fiber. Fiber adds keyword-only arguments, as :class:`Pool`
    does: ``backend`` (a backend for the workers), and the resources of each worker's job
    ``cpu``, ``memory`` (MiB), ``gpu``, ``gpu_type``, ``image``.

    See the module's documentation for when it reports ``BrokenProcessPool``: a worker
    lost to the infrastructure is replaced and its task re-run, where the stdlib breaks.
    """

    def __init__(self, max_workers: int | None = None, mp_context: Any = None,
                 initializer: Callable | None = None, initargs: tuple = (),
                 max_tasks_per_child: int | None = None, *, backend: str | None = None,
                 cpu: float | None = None, memory: int | None = None, gpu: int | None = None,
                 gpu_type: str | None = None, image: str | None = None) -> None:
        if max_workers is None:
            max_workers = cpu_count()
        elif max_workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        if mp_context is not None and not isinstance(mp_context, FiberContext):
            raise TypeError(
                f"mp_context must be None or a Fiber context (fiber_core.get_context()), not "
                f"{mp_context!r}: the workers of fiber_core.futures.ProcessPoolExecutor are "
                "Fiber jobs. For the stdlib's start methods use concurrent.futures."
            )
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        if max_tasks_per_child is not None:
            if not isinstance(max_tasks_per_child, int) or isinstance(max_tasks_per_child, bool):
                raise TypeError("max_tasks_per_child must be an integer")
            if max_tasks_per_child <= 0:
                raise ValueError("max_tasks_per_child must be >= 1")
        self._max_workers = max_workers
        self._mp_context = mp_context
        resources = {"cpu": cpu, "memory": memory, "gpu": gpu, "gpu_type": gpu_type, "image": image}
        self._dispatcher = _Dispatcher(
            max_workers, (initializer, tuple(initargs), max_tasks_per_child),
            {"backend": backend, **{k: v for k, v in resources.items() if v is not None}})
        # Dropped without shutdown(): the submitted calls finish, then the pool closes.
        self._finalizer = weakref.finalize(self, self._dispatcher.shutdown, False, False)
        self._finalizer.atexit = False

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Future:
        """Schedule ``fn(*args, **kwargs)``; return a :class:`~concurrent.futures.Future`.

        A function or argument that cannot be pickled fails the future at once.
        """
        return self._dispatcher.submit(_Call(fn, args, kwargs))

    def map(self, fn: Callable, *iterables: Iterable, timeout: float | None = None,
            chunksize: int = 1, buffersize: int | None = None) -> Iterator:
        """``map(fn, *iterables)`` in the workers: results in order, as an iterator.

        All calls are submitted now, unless ``buffersize`` (Python 3.14's argument, on every
        Python here): then at most that many tasks wait for their result to be taken, and
        the input is read as results are (an endless iterable works). ``timeout`` (seconds,
        from this call) bounds the wait for each result. ``chunksize`` calls travel and run
        as one task.
        """
        if buffersize is not None and (not isinstance(buffersize, int) or isinstance(buffersize, bool)):
            raise TypeError("buffersize must be an integer or None")
        if buffersize is not None and buffersize < 1:
            raise ValueError("buffersize must be None or > 0")
        if chunksize < 1:
            raise ValueError("chunksize must be >= 1.")
        end_time = None if timeout is None else timeout + time.monotonic()
        chunks = _chunks(iterables, chunksize)
        fs = collections.deque(self._dispatcher.submit(_Call(fn, (), {}, chunk))
                               for chunk in itertools.islice(chunks, buffersize))
        executor = weakref.ref(self)  # the iterator keeps no executor alive (as the stdlib's)

        def result_iterator() -> Iterator:
            try:
                fs.reverse()  # pop from the end: no reference kept to a yielded result
                while fs:
                    if buffersize is not None and (e := executor()) is not None:
                        chunk = next(chunks, None)
                        if chunk is not None:
                            fs.appendleft(e._dispatcher.submit(_Call(fn, (), {}, chunk)))  # noqa: SLF001 - the executor's map submits through its dispatcher, in this module
                        del e
                    if end_time is None:
                        yield from _result_or_cancel(fs.pop())
                    else:
                        yield from _result_or_cancel(fs.pop(), end_time - time.monotonic())
            finally:
                for future in fs:
                    future.cancel()

        return result_iterator()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new calls; with ``wait``, return once every submitted call has finished and
        the workers have exited. ``cancel_futures`` cancels the calls not yet running."""
        self._dispatcher.shutdown(wait, cancel_futures)

    def terminate_workers(self) -> None:
        """End every worker now (Python 3.14's method, on every Python here): the calls not
        yet running are cancelled, the running ones fail with ``BrokenProcessPool``, and the
        executor takes no new call. Returns without waiting for the workers to end.

        The same as :meth:`kill_workers` here: SIGTERM asks a Fiber pool worker to finish its
        batch first (it is how a platform drains it), so both stop the jobs at once."""
        self._dispatcher.stop_workers("terminate_workers")

    def kill_workers(self) -> None:
        """End every worker now with SIGKILL (Python 3.14's method, on every Python here);
        otherwise as :meth:`terminate_workers`."""
        self._dispatcher.stop_workers("kill_workers")

    def __reduce__(self) -> None:  # type: ignore[override]
        raise TypeError("executor objects cannot be passed between processes or pickled")


FiberExecutor = ProcessPoolExecutor
