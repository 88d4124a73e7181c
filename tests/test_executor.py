"""``fiber_core.futures.ProcessPoolExecutor`` on the local backend: the stdlib's API, then Fiber's rules.

Real workers, real :class:`concurrent.futures.Future` objects; nothing is mocked. Tasks
that must be held wait on a ``fiber_core.Queue`` (a *gate*) the test opens; tests learn
that something happened from a queue, a future or a file, never from a sleep. ``T``
bounds every wait: reaching it is a failure, never a measure of speed.
"""

from __future__ import annotations

import concurrent.futures as cf
import gc
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import pytest
from procs import wait_until

import fiber_core
import fiber_core.futures
from fiber_core.base.errors import JobStartError, PicklingError, TaskLostError, UnknownBackendError
from fiber_core.futures import FiberExecutor, ProcessPoolExecutor
from fiber_core.parallel.executor import QUEUED_PER_WORKER
from fiber_core.parallel.pool import MAX_TASK_ATTEMPTS, MaybeEncodingError, RemoteTraceback

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed


# -- tasks (module level: workers import this module to find them) -----------------------


def sqr(x: int) -> int:
    return x * x


def mul(x: int, y: int = 1) -> int:
    return x * y


def pid_of(_: object = None) -> int:
    return os.getpid()


def gated(x: int, gate: fiber_core.Queue, started: fiber_core.Queue | None = None) -> int:
    """Tell ``started`` this task runs, then wait until the test opens ``gate``."""
    if started is not None:
        started.put(x)
    gate.get(timeout=T)
    return x


def task_that_raises(x: int) -> int:
    if x == 5:
        raise RuntimeError(f"task failed on {x}")  # the raising line
    return x


_initialized: object = None


def set_global(value: object) -> None:
    global _initialized
    _initialized = value


def read_global() -> object:
    return _initialized


def failing_initializer() -> None:
    import fiber_no_such_module_for_this_test  # noqa: F401


def return_lock() -> threading.Lock:
    return threading.Lock()


def exit_worker(record: str) -> None:
    """Kill the worker that runs it, every time (after noting that it ran)."""
    fd = os.open(record, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, b"ran\n")
    os.close(fd)
    os._exit(1)


def held_on_first_run(x: int, marker: str, started: fiber_core.Queue, gate: fiber_core.Queue) -> int:
    """The first run reports its pid and waits at ``gate``; a later run returns at once."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return x
    started.put(os.getpid())
    gate.get(timeout=T)
    return x


# -- helpers -------------------------------------------------------------------------



@pytest.fixture
def executor() -> Iterator[ProcessPoolExecutor]:
    ex = ProcessPoolExecutor(2)
    yield ex
    ex.shutdown(wait=True, cancel_futures=True)


# -- the stdlib's API ------------------------------------------------------------------


def test_names() -> None:
    assert FiberExecutor is ProcessPoolExecutor
    assert issubclass(ProcessPoolExecutor, cf.Executor)
    for name in ("Future", "wait", "as_completed", "FIRST_COMPLETED", "ALL_COMPLETED",
                 "FIRST_EXCEPTION", "CancelledError", "TimeoutError", "BrokenExecutor"):
        assert getattr(fiber_core.futures, name) is getattr(cf, name)
    assert fiber_core.futures.BrokenProcessPool is BrokenProcessPool


def test_submit_returns_real_futures(executor: ProcessPoolExecutor) -> None:
    f = executor.submit(sqr, 7)
    assert isinstance(f, cf.Future)
    assert f.result(timeout=T) == 49
    assert executor.submit(mul, 6, y=7).result(timeout=T) == 42
    assert executor.submit(lambda a, b: a + b, 1, b=2).result(timeout=T) == 3  # by value
    assert f.done() and not f.running() and not f.cancelled()


def test_as_completed_wait_and_callbacks(executor: ProcessPoolExecutor) -> None:
    fs = [executor.submit(sqr, i) for i in range(20)]
    assert sorted(f.result() for f in cf.as_completed(fs, timeout=T)) == [i * i for i in range(20)]

    gate = fiber_core.Queue()
    held = executor.submit(gated, 1, gate)
    quick = executor.submit(sqr, 3)
    done, not_done = cf.wait([held, quick], timeout=T, return_when=cf.FIRST_COMPLETED)
    assert done == {quick} and not_done == {held}
    seen: list[cf.Future] = []
    called = threading.Event()

    def callback(f: cf.Future) -> None:
        seen.append(f)
        called.set()

    held.add_done_callback(callback)
    gate.put(None)
    done, not_done = cf.wait([held, quick], timeout=T, return_when=cf.ALL_COMPLETED)
    assert not not_done
    assert called.wait(T) and seen == [held]


def test_map(executor: ProcessPoolExecutor) -> None:
    assert list(executor.map(sqr, range(10))) == [x * x for x in range(10)]
    assert list(executor.map(sqr, range(100), chunksize=7)) == [x * x for x in range(100)]
    assert list(executor.map(mul, range(5), range(5, 100))) == [x * y for x, y in zip(range(5), range(5, 10))]
    assert list(executor.map(sqr, [])) == []
    assert list(executor.map(sqr, (x for x in range(7)), timeout=T)) == [x * x for x in range(7)]
    with pytest.raises(ValueError, match="chunksize must be >= 1"):
        executor.map(sqr, range(3), chunksize=0)


def test_map_raises_the_first_error_in_order(executor: ProcessPoolExecutor) -> None:
    it = executor.map(task_that_raises, range(10), chunksize=2)
    assert [next(it) for _ in range(4)] == [0, 1, 2, 3]  # item 5 fails the chunk (4, 5)
    with pytest.raises(RuntimeError, match="task failed on 5"):
        next(it)


def test_map_timeout(executor: ProcessPoolExecutor) -> None:
    gate = fiber_core.Queue()
    it = executor.map(gated, [1, 2], [gate, gate], timeout=0.2)
    with pytest.raises(cf.TimeoutError):
        next(it)
    gate.put(None)
    gate.put(None)
    assert executor.submit(sqr, 2).result(timeout=T) == 4


def test_exception_carries_the_remote_traceback(executor: ProcessPoolExecutor) -> None:
    f = executor.submit(task_that_raises, 5)
    with pytest.raises(RuntimeError, match="task failed on 5") as info:
        f.result(timeout=T)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "task_that_raises" in str(cause)
    assert 'raise RuntimeError(f"task failed on {x}")  # the raising line' in str(cause)
    assert isinstance(f.exception(), RuntimeError)
    with pytest.raises(RuntimeError) as info:
        list(executor.map(task_that_raises, range(10), chunksize=3))
    assert isinstance(info.value.__cause__, RemoteTraceback)


def test_unpicklable_argument_fails_its_future_not_the_executor(executor: ProcessPoolExecutor) -> None:
    lock = threading.Lock()
    f = executor.submit(sqr, lock)
    with pytest.raises(PicklingError, match="lock"):
        f.result(timeout=T)
    assert isinstance(f.exception(), TypeError)  # as the stdlib's pickling errors
    with pytest.raises(PicklingError):
        list(executor.map(sqr, [1, lock]))
    # a result that cannot be pickled in the worker: that future's error
    with pytest.raises(MaybeEncodingError, match="lock"):
        executor.submit(return_lock).result(timeout=T)
    assert executor.submit(sqr, 4).result(timeout=T) == 16


def test_initializer_and_initargs() -> None:
    with ProcessPoolExecutor(2, initializer=set_global, initargs=("ready",)) as ex:
        assert {ex.submit(read_global).result(timeout=T) for _ in range(4)} == {"ready"}


def test_max_tasks_per_child_replaces_workers() -> None:
    with ProcessPoolExecutor(1, max_tasks_per_child=1) as ex:
        pids = [ex.submit(pid_of).result(timeout=T) for _ in range(3)]
    assert len(set(pids)) == 3


def test_arguments_are_checked_at_once() -> None:
    with pytest.raises(ValueError, match="max_workers must be greater than 0"):
        ProcessPoolExecutor(0)
    with pytest.raises(TypeError, match="initializer must be a callable"):
        ProcessPoolExecutor(1, initializer=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_tasks_per_child must be >= 1"):
        ProcessPoolExecutor(1, max_tasks_per_child=0)
    with pytest.raises(TypeError, match="max_tasks_per_child must be an integer"):
        ProcessPoolExecutor(1, max_tasks_per_child="1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fiber_core.get_context"):
        ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    with pytest.raises(TypeError, match="backends"):
        ProcessPoolExecutor(1, backends="local")  # type: ignore[call-arg]
    contexts: list[Any] = [fiber_core.get_context(), fiber_core.get_context("spawn"),
                           multiprocessing.get_context("fiber")]
    for ctx in contexts:
        with ProcessPoolExecutor(1, mp_context=ctx) as ex:
            assert ex.submit(sqr, 3).result(timeout=T) == 9


def test_bad_backend_fails_the_first_submit() -> None:
    ex = ProcessPoolExecutor(1, backend="no-such-backend")  # nothing is started yet
    with pytest.raises(UnknownBackendError, match="no-such-backend"):
        ex.submit(sqr, 1)
    ex.shutdown()


def test_queued_calls_can_be_cancelled_running_ones_cannot() -> None:
    gate, started = fiber_core.Queue(), fiber_core.Queue()
    ex = ProcessPoolExecutor(1)
    try:
        running = [ex.submit(gated, i, gate, started) for i in range(QUEUED_PER_WORKER)]
        queued = [ex.submit(sqr, i) for i in range(4)]
        assert started.get(timeout=T) == 0
        wait_until(lambda: all(f.running() for f in running), "the first calls were handed over")
        assert not any(f.running() or f.done() for f in queued)  # held back: still cancellable
        assert not running[0].cancel()
        assert queued[0].cancel() and queued[0].cancelled()
        with pytest.raises(cf.CancelledError):
            queued[0].result(timeout=T)
        ex.shutdown(wait=False, cancel_futures=True)
        assert all(f.cancelled() for f in queued)
        with pytest.raises(RuntimeError, match="after shutdown"):
            ex.submit(sqr, 1)
        for _ in running:
            gate.put(None)
        assert [f.result(timeout=T) for f in running] == list(range(QUEUED_PER_WORKER))
    finally:
        ex.shutdown(wait=True)
    wait_until(lambda: not fiber_core.active_children(), "the workers exited")


def test_shutdown_waits_for_every_submitted_call() -> None:
    ex = ProcessPoolExecutor(2)
    fs = [ex.submit(sqr, i) for i in range(20)]
    ex.shutdown(wait=True)
    assert all(f.done() for f in fs)
    assert [f.result() for f in fs] == [i * i for i in range(20)]
    assert not fiber_core.active_children()  # the pool was closed and joined
    ex.shutdown()  # again: nothing to do


def test_context_manager() -> None:
    with ProcessPoolExecutor(2) as ex:
        fs = [ex.submit(sqr, i) for i in range(10)]
    assert [f.result(timeout=0) for f in fs] == [i * i for i in range(10)]
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(sqr, 1)


def test_shutdown_from_a_done_callback_returns(executor: ProcessPoolExecutor) -> None:
    returned = threading.Event()

    def stop(_: cf.Future) -> None:
        executor.shutdown(wait=True)  # in the pool's master thread: must not wait for itself
        returned.set()

    f = executor.submit(sqr, 2)
    f.add_done_callback(stop)
    assert f.result(timeout=T) == 4
    assert returned.wait(T)


def test_dropped_executor_finishes_its_calls_then_closes() -> None:
    fs = [ProcessPoolExecutor(1).submit(sqr, 3)]
    gc.collect()
    assert fs[0].result(timeout=T) == 9
    wait_until(lambda: not fiber_core.active_children(), "the workers of the dropped executor exited")


@pytest.mark.skipif((3, 12, 0) <= sys.version_info[:3] < (3, 12, 2),
                    reason="CPython 3.12.0 and 3.12.1 forbid new threads at exit (gh-113964): "
                           "the executor warns instead (test_exit_warning_where_threads_cannot_start)")
def test_calls_submitted_before_exit_finish(run_script: Callable, tmp_path: Path) -> None:
    out = tmp_path / "lines"
    done = run_script(f"""
        import os
        from fiber_core.futures import ProcessPoolExecutor

        def note(i):
            fd = os.open({str(out)!r}, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.write(fd, b"%d\\n" % i)
            os.close(fd)

        if __name__ == "__main__":
            ex = ProcessPoolExecutor(2)
            for i in range(20):
                ex.submit(note, i)
            # no shutdown(): as with the stdlib, they finish before the interpreter exits
    """)
    assert done.returncode == 0, done.stderr
    assert sorted(map(int, out.read_text().split())) == list(range(20))


@pytest.mark.skipif(not (3, 12, 0) <= sys.version_info[:3] < (3, 12, 2),
                    reason="only CPython 3.12.0 and 3.12.1 forbid new threads at exit")
def test_exit_warning_where_threads_cannot_start(run_script: Callable) -> None:
    done = run_script("""
        from fiber_core.futures import ProcessPoolExecutor

        def noop(i):
            return i

        if __name__ == "__main__":
            ex = ProcessPoolExecutor(2)
            for i in range(20):
                ex.submit(noop, i)
    """)
    assert "Call shutdown() (or use `with`) first" in done.stderr


# -- when the executor is broken -------------------------------------------------------------


def test_task_that_kills_its_worker_breaks_the_executor(tmp_path: Path) -> None:
    record = tmp_path / "runs"
    gate = fiber_core.Queue()
    with ProcessPoolExecutor(2) as ex:
        assert ex.submit(sqr, 2).result(timeout=T) == 4
        held = ex.submit(gated, 1, gate)
        killer = ex.submit(exit_worker, str(record))
        queued = [ex.submit(gated, i, gate) for i in range(6)]
        with pytest.raises(BrokenProcessPool) as info:
            killer.result(timeout=T)
        assert isinstance(info.value.__cause__, TaskLostError)
        # Fiber retried it: once not watched (uncharged), then MAX_TASK_ATTEMPTS times watched
        assert record.read_text().count("ran") == MAX_TASK_ATTEMPTS + 1
        # as the stdlib: every pending future fails, and the executor takes no more work
        for f in [held, *queued]:
            assert isinstance(f.exception(timeout=T), BrokenProcessPool)
        with pytest.raises(BrokenProcessPool, match="not usable anymore"):
            ex.submit(sqr, 1)
    wait_until(lambda: not fiber_core.active_children(), "the workers were stopped")


def test_failing_initializer_breaks_the_executor() -> None:
    ex = ProcessPoolExecutor(2, initializer=failing_initializer)
    try:
        f = ex.submit(sqr, 1)
        with pytest.raises(BrokenProcessPool) as info:
            f.result(timeout=T)
        cause = info.value.__cause__
        assert isinstance(cause, JobStartError)
        assert "fiber_no_such_module_for_this_test" in str(cause)  # the worker's log
        with pytest.raises(BrokenProcessPool):
            ex.submit(sqr, 1)
    finally:
        ex.shutdown()


def test_worker_lost_from_outside_is_replaced_not_broken(tmp_path: Path) -> None:
    """Where the stdlib breaks, Fiber re-runs the task of a worker lost to the infrastructure."""
    started, gate = fiber_core.Queue(), fiber_core.Queue()
    with ProcessPoolExecutor(2) as ex:
        f = ex.submit(held_on_first_run, 7, str(tmp_path / "marker"), started, gate)
        os.kill(started.get(timeout=T), signal.SIGKILL)  # as an out-of-memory kill or a lost node
        assert f.result(timeout=T) == 7
        assert ex.submit(sqr, 5).result(timeout=T) == 25


# -- the stdlib's executor on Fiber's context -----------------------------------------------


@pytest.mark.parametrize("ctx", ["fiber_core", "stdlib name"])
def test_stdlib_executor_on_fiber_context_fails_at_once(ctx: str) -> None:
    context: Any = fiber_core.get_context() if ctx == "fiber_core" else multiprocessing.get_context("fiber")
    with pytest.raises(ValueError, match=r"fiber_core\.futures\.ProcessPoolExecutor"):
        cf.ProcessPoolExecutor(2, mp_context=context)
    if sys.version_info >= (3, 11):  # the stdlib's argument since 3.11
        with pytest.raises(ValueError, match=r"fiber_core\.futures\.ProcessPoolExecutor"):
            cf.ProcessPoolExecutor(2, mp_context=context, max_tasks_per_child=3)
    assert not fiber_core.active_children()
    assert context.get_start_method() == "fiber"  # anyone else may still ask
