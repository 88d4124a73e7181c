"""``fiber_core.Pool`` on the local backend: the stdlib's pool cases, then Fiber's guarantees.

Every test runs real worker processes; nothing is mocked. Tasks that must be held
wait on a ``fiber_core.Queue`` (a *gate*) that the test opens, and tests learn that
something happened from a queue, a result or the pool's own state, never from a
sleep. ``T`` bounds every wait: reaching it is a failure, never a measure of speed.

The first part mirrors the pool cases of CPython's ``Lib/test/_test_multiprocessing.py``
where they apply; the second holds Fiber's own promises (remote tracebacks, pickling
errors in the caller, worker deaths, start failures, ``terminate``, ``resize``).
"""

from __future__ import annotations

import functools
import os
import pickle
import random
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from pool_worker_tasks import pool_modules
from procs import wait_until

import fiber_core
from fiber_core.base.errors import BackendError, FiberError, JobStartError, PicklingError
from fiber_core.base.oom import oom_kills
from fiber_core.parallel.pool import MAX_TASK_ATTEMPTS, MaybeEncodingError, Pool, RemoteTraceback
from fiber_core.parallel.pool.ledger import MAX_TASK_KILLS
from fiber_core.runtime.run import runtime

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed


# -- tasks (module level: workers import this module to find them) -----------------------


def sqr(x: int) -> int:
    return x * x


def mul(x: int, y: int) -> int:
    return x * y


def identity(x: object) -> object:
    return x


def one_ms(x: int) -> int:
    time.sleep(0.001)  # the work itself (~1 ms), not synchronisation
    return x


def pid_and_square(x: int) -> tuple[int, int]:
    return os.getpid(), x * x


def gated(x: int, gate: fiber_core.Queue, started: fiber_core.Queue | None = None) -> int:
    """Tell ``started`` this task runs, then wait until the test opens ``gate``."""
    if started is not None:
        started.put(x)
    gate.get(timeout=T)
    return x


def task_that_raises(x: int) -> int:
    if x == 5:
        raise RuntimeError(f"task failed on {x}")  # the raising line
    return x * x


def raise_key_error() -> None:
    raise KeyError("raised in the worker")


class SayWhenError(ValueError):
    pass


def exception_throwing_generator(total: int, when: int) -> Iterator[int]:
    """As in CPython's tests: yields ``range(total)`` but raises at ``when``."""
    if when == -1:
        raise SayWhenError("Somebody said when")
    for i in range(total):
        if i == when:
            raise SayWhenError("Somebody said when")
        yield i


_initialized: object = None


def set_global(value: object) -> None:
    global _initialized
    _initialized = value


def read_global(_: object) -> object:
    return _initialized


def take_ticket(tickets: fiber_core.Queue) -> None:
    """An initializer that holds the worker until the test hands out a ticket."""
    tickets.get(timeout=T)


def failing_initializer() -> None:
    import fiber_no_such_module_for_this_test  # noqa: F401


def make_a_pool() -> int:
    with Pool(1) as p:
        return p.apply(sqr, (2,))


def return_lock() -> threading.Lock:
    return threading.Lock()


def return_lock_on(x: int, bad: int) -> object:
    return threading.Lock() if x == bad else x


def raise_with_lock() -> None:
    raise ValueError(threading.Lock())


class NeedsTwoArgs(Exception):
    """Pickles fine in the worker, but ``NeedsTwoArgs(*args)`` fails when it is unpickled."""

    def __init__(self, a: object, b: object) -> None:
        super().__init__(a)
        self.b = b


def raise_needs_two_args() -> None:
    raise NeedsTwoArgs("a", "b")


def die_on(x: int, bad: int, how: str, record: str) -> int:
    """Return ``x``, except that item ``bad`` kills the worker that runs it (every time)."""
    if x == bad:
        fd = os.open(record, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, b"ran\n")
        os.close(fd)
        if how == "exit":
            os._exit(1)
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def report_at(x: int, marks: frozenset[int], reports: fiber_core.Queue,
              acks: fiber_core.Queue | None = None) -> int:
    """~1 ms of work; at the items in ``marks`` report this worker's pid (and wait for an ack)."""
    if x in marks:
        reports.put(os.getpid())
        if acks is not None:
            acks.get(timeout=T)
    time.sleep(0.001)  # the work itself, not synchronisation
    return x


# -- helpers -------------------------------------------------------------------------



def pid_gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


def kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def kill_random_worker(pool: Pool, rng: random.Random, spare: set[int],
                       also_spare: frozenset[int] = frozenset()) -> int:
    """SIGKILL a random worker of ``pool``; add its pid to ``spare`` and return it.

    Spared: the pids in ``spare`` and ``also_spare`` (earlier victims, whose exit the pool
    may not have seen yet), and any worker that holds a task a death was already charged
    to. A task that dies with ``MAX_TASK_ATTEMPTS`` workers is failed on purpose (the
    poison-task rule, tested on its own); random chaos must not play that rule. The choice
    and the kill happen under the pool's lock, so no batch is handed out in between.
    """
    deadline = time.monotonic() + T
    pause = threading.Event()
    while True:
        with pool._lock:
            victims = [
                w.process.pid for w in pool._workers.values()
                if w.process.pid is not None and w.process.pid not in spare | also_spare
                and not w.lost
                and not any(u.charges for batch in list(w.pending.values()) for u in batch)
            ]
            if victims:
                pid = rng.choice(victims)
                kill_quietly(pid)
                spare.add(pid)
                return pid
        if time.monotonic() > deadline:
            pytest.fail("no worker could be killed")
        pause.wait(0.01)  # a replacement is starting, or a retried task is finishing


@pytest.fixture
def pool() -> Iterator[Pool]:
    p = Pool(2)
    yield p
    p.terminate()


# -- CPython's pool cases ----------------------------------------------------------------


def test_apply(pool: Pool) -> None:
    assert pool.apply(sqr, (5,)) == 25
    assert pool.apply(sqr, (), {"x": 3}) == 9
    assert pool.apply(mul, (6,), {"y": 7}) == 42


def test_apply_async_and_callback(pool: Pool) -> None:
    got: list[object] = []
    res = pool.apply_async(sqr, (7,), callback=got.append)
    assert res.get(timeout=T) == 49
    assert got == [49]  # the callback ran before the result became ready
    assert res.ready() and res.successful()


def test_apply_async_error_callback(pool: Pool) -> None:
    errors: list[BaseException] = []
    res = pool.apply_async(raise_key_error, error_callback=errors.append)
    with pytest.raises(KeyError):
        res.get(timeout=T)
    assert len(errors) == 1 and isinstance(errors[0], KeyError)
    assert res.ready() and not res.successful()


def test_map(pool: Pool) -> None:
    assert pool.map(sqr, list(range(10))) == [x * x for x in range(10)]
    assert pool.map(sqr, list(range(100)), chunksize=20) == [x * x for x in range(100)]
    assert pool.map(sqr, range(7)) == [x * x for x in range(7)]
    assert pool.map(sqr, (x for x in range(7))) == [x * x for x in range(7)]


def test_map_async(pool: Pool) -> None:
    res = pool.map_async(sqr, list(range(10)))
    assert res.get(timeout=T) == [x * x for x in range(10)]


def test_map_async_callbacks(pool: Pool) -> None:
    call_args: list[object] = []
    pool.map_async(int, ["1"], callback=call_args.append,
                   error_callback=call_args.append).wait(T)
    assert call_args == [[1]]
    res = pool.map_async(int, ["a"], callback=call_args.append,
                         error_callback=call_args.append)
    res.wait(T)
    assert len(call_args) == 2
    assert isinstance(call_args[1], ValueError)
    with pytest.raises(ValueError):
        res.get(timeout=T)


def test_map_empty(pool: Pool) -> None:
    assert pool.map(sqr, []) == []
    assert pool.map_async(sqr, [], chunksize=1).get(timeout=T) == []
    assert pool.starmap(mul, []) == []
    assert list(pool.imap(sqr, [])) == []
    assert list(pool.imap_unordered(sqr, [])) == []
    got: list[object] = []
    assert pool.map_async(sqr, [], callback=got.append).get(timeout=T) == []


def test_map_handle_iterable_exception(pool: Pool) -> None:
    with pytest.raises(SayWhenError):
        pool.map(sqr, exception_throwing_generator(1, -1), 1)
    with pytest.raises(SayWhenError):
        pool.map(sqr, exception_throwing_generator(10, 5), 1)
    assert pool.map(sqr, range(3)) == [0, 1, 4]


def test_starmap(pool: Pool) -> None:
    tuples = list(zip(range(10), range(9, -1, -1)))
    assert pool.starmap(mul, tuples) == [x * y for x, y in tuples]
    tuples = list(zip(range(100), range(99, -1, -1)))
    assert pool.starmap(mul, tuples, chunksize=6) == [x * y for x, y in tuples]


def test_starmap_async(pool: Pool) -> None:
    tuples = list(zip(range(100), range(99, -1, -1)))
    got: list[object] = []
    res = pool.starmap_async(mul, tuples, callback=got.append)
    assert res.get(timeout=T) == [x * y for x, y in tuples]
    assert got == [[x * y for x, y in tuples]]


def test_imap(pool: Pool) -> None:
    it = pool.imap(sqr, list(range(10)))
    assert list(it) == [x * x for x in range(10)]

    it = pool.imap(sqr, list(range(10)))
    for i in range(10):
        assert it.next(timeout=T) == i * i
    with pytest.raises(StopIteration):
        it.next(timeout=T)

    it = pool.imap(sqr, list(range(1000)), chunksize=100)
    for i in range(1000):
        assert it.next(timeout=T) == i * i
    with pytest.raises(StopIteration):
        it.next(timeout=T)


def test_imap_lazy_generator(pool: Pool) -> None:
    assert list(pool.imap(sqr, (x for x in range(50)))) == [x * x for x in range(50)]
    assert list(pool.imap(sqr, (x for x in range(50)), chunksize=7)) == [x * x for x in range(50)]
    assert sorted(pool.imap_unordered(sqr, (x for x in range(50)), chunksize=7)) == [
        x * x for x in range(50)]


def test_imap_handle_iterable_exception(pool: Pool) -> None:
    it = pool.imap(sqr, exception_throwing_generator(10, 3), 1)
    for i in range(3):
        assert it.next(timeout=T) == i * i
    with pytest.raises(SayWhenError):
        it.next(timeout=T)
    with pytest.raises(StopIteration):
        it.next(timeout=T)

    # SayWhenError seen at start of a chunk of size 2
    it = pool.imap(sqr, exception_throwing_generator(20, 7), 2)
    for i in range(6):
        assert it.next(timeout=T) == i * i
    with pytest.raises(SayWhenError):
        it.next(timeout=T)

    # SayWhenError seen in the middle of a chunk of size 4
    it = pool.imap(sqr, exception_throwing_generator(10, 5), 4)
    for i in range(4):
        assert it.next(timeout=T) == i * i
    with pytest.raises(SayWhenError):
        it.next(timeout=T)


def test_imap_unordered_handle_iterable_exception(pool: Pool) -> None:
    for chunksize in (1, 2):
        it = pool.imap_unordered(sqr, exception_throwing_generator(10, 3), chunksize)
        expected = [x * x for x in range(10)]
        with pytest.raises(SayWhenError):
            for _ in range(10):
                value = it.next(timeout=T)
                assert value in expected
                expected.remove(value)


def test_imap_task_exception_in_the_middle(pool: Pool) -> None:
    # The exception comes at its position, and iteration goes on after it.
    it = pool.imap(task_that_raises, range(10))
    for i in range(5):
        assert it.next(timeout=T) == i * i
    with pytest.raises(RuntimeError, match="task failed on 5"):
        it.next(timeout=T)
    assert [it.next(timeout=T) for _ in range(6, 10)] == [i * i for i in range(6, 10)]
    with pytest.raises(StopIteration):
        it.next(timeout=T)

    # With chunksize > 1, the failing chunk is one exception, at its position.
    it = pool.imap(task_that_raises, range(10), chunksize=3)
    assert [it.next(timeout=T) for _ in range(3)] == [0, 1, 4]
    with pytest.raises(RuntimeError, match="task failed on 5"):
        it.next(timeout=T)
    assert list(it) == [i * i for i in range(6, 10)]


def test_imap_unordered(pool: Pool) -> None:
    assert sorted(pool.imap_unordered(sqr, list(range(10)))) == [x * x for x in range(10)]
    assert sorted(pool.imap_unordered(sqr, list(range(1000)), chunksize=53)) == [
        x * x for x in range(1000)]
    values, errors = [], []
    it = pool.imap_unordered(task_that_raises, range(10))
    for _ in range(10):
        try:
            values.append(it.next(timeout=T))
        except RuntimeError as e:
            errors.append(e)
    assert sorted(values) == [i * i for i in range(10) if i != 5]
    assert [str(e) for e in errors] == ["task failed on 5"]
    with pytest.raises(StopIteration):
        it.next(timeout=T)


def test_chunksize_groups_work(pool: Pool) -> None:
    out = pool.map(pid_and_square, range(40), chunksize=10)
    assert [sq for _, sq in out] == [x * x for x in range(40)]
    for start in range(0, 40, 10):  # a chunk runs in one worker
        assert len({pid for pid, _ in out[start:start + 10]}) == 1
    with pytest.raises(ValueError):
        pool.map(sqr, range(3), chunksize=0)
    with pytest.raises(ValueError):
        pool.imap(sqr, range(3), chunksize=0)


def test_get_timeout_wait_ready_successful(pool: Pool) -> None:
    gate, started = fiber_core.Queue(), fiber_core.Queue()
    res = pool.apply_async(gated, (6, gate, started))
    assert started.get(timeout=T) == 6  # it runs, and cannot finish until the gate opens
    assert not res.ready()
    with pytest.raises(ValueError):
        res.successful()
    with pytest.raises(fiber_core.TimeoutError):
        res.get(timeout=0.01)
    assert fiber_core.TimeoutError is __import__("multiprocessing").TimeoutError
    assert res.wait(0.01) is None
    assert not res.ready()
    gate.put(None)
    res.wait(T)
    assert res.ready() and res.successful()
    assert res.get(timeout=T) == 6


def test_imap_next_timeout(pool: Pool) -> None:
    gate = fiber_core.Queue()
    it = pool.imap(functools.partial(gated, gate=gate), [1, 2])
    with pytest.raises(fiber_core.TimeoutError):
        it.next(timeout=0.01)
    gate.put(None)
    gate.put(None)
    assert list(it) == [1, 2]


def test_processes_argument() -> None:
    with pytest.raises(ValueError):
        Pool(0)
    with pytest.raises(ValueError):
        Pool(-1)
    with pytest.raises(ValueError):
        Pool(2, maxtasksperchild=0)
    with Pool(3) as p:
        # Local workers start at most starts_per_cpu per CPU at a time; the rest follow as
        # those become ready, until the pool has its size.
        with p._lock:
            starting = sum(not w.ready for w in p._workers.values())
        assert starting <= fiber_core.cpu_count() * runtime().backend.starts_per_cpu
        wait_until(lambda: len(p._pool) == 3 and all(w.ready for w in list(p._workers.values())),
                   "the pool's 3 workers to be up")
    with Pool() as p:
        wait_until(lambda: len(p._pool) == fiber_core.cpu_count(), "one worker per CPU")
        assert p.map(sqr, range(4)) == [0, 1, 4, 9]


def test_initializer_and_initargs() -> None:
    with Pool(2, initializer=set_global, initargs=("ready",)) as p:
        assert p.map(read_global, range(20)) == ["ready"] * 20
    with pytest.raises(TypeError):
        Pool(1, initializer=42)  # type: ignore[arg-type]


def test_maxtasksperchild_replaces_workers() -> None:
    with Pool(2, maxtasksperchild=3) as p:
        first = {w.pid for w in p._pool}
        results = [p.apply_async(pid_and_square, (i,)) for i in range(18)]
        got = [r.get(timeout=T) for r in results]
        assert [sq for _, sq in got] == [i * i for i in range(18)]
        per_worker = Counter(pid for pid, _ in got)
        assert max(per_worker.values()) <= 3
        assert len(per_worker) >= 6
        assert None not in {w.pid for w in p._pool}
        assert {w.pid for w in p._pool} != first
        # and map is still right with workers coming and going
        assert p.map(sqr, range(50), chunksize=2) == [x * x for x in range(50)]


def test_maxtasksperchild_early_close() -> None:
    p = Pool(3, maxtasksperchild=1)
    results = [p.apply_async(sqr, (i,)) for i in range(6)]
    p.close()
    p.join()
    assert [r.get(timeout=T) for r in results] == [i * i for i in range(6)]


def test_context_manager_terminates() -> None:
    expected = [x * x for x in range(10)]
    with Pool(2) as p:
        workers = list(p._pool)
        assert p.map_async(sqr, range(10)).get(timeout=T) == expected
    p.join()
    for w in workers:
        w.join(T)
        assert w.exitcode is not None
    with pytest.raises(ValueError):
        p.map_async(sqr, range(10))
    with pytest.raises(ValueError), p:
        pass


def test_close_and_join() -> None:
    p = Pool(2)
    workers = list(p._pool)
    res = p.map_async(sqr, range(20))
    p.close()
    p.join()
    assert res.get(timeout=T) == [x * x for x in range(20)]
    assert [w.exitcode for w in workers] == [0, 0]


def test_join_before_close_is_an_error(pool: Pool) -> None:
    with pytest.raises(ValueError):
        pool.join()


def test_submitting_after_close_is_an_error(pool: Pool) -> None:
    pool.close()
    for submit in (lambda: pool.apply(sqr, (1,)), lambda: pool.apply_async(sqr, (1,)),
                   lambda: pool.map(sqr, [1]), lambda: pool.map_async(sqr, [1]),
                   lambda: pool.starmap(mul, [(1, 2)]), lambda: pool.imap(sqr, [1]),
                   lambda: pool.imap_unordered(sqr, [1])):
        with pytest.raises(ValueError):
            submit()
    pool.join()


def test_pool_cannot_be_pickled(pool: Pool) -> None:
    with pytest.raises(NotImplementedError):
        pickle.dumps(pool)
    with pytest.raises(PicklingError):
        pool.apply_async(identity, (pool,))


def test_pool_inside_a_task_is_a_clear_error(pool: Pool) -> None:
    with pytest.raises(AssertionError, match="daemonic processes are not allowed to have children"):
        pool.apply_async(make_a_pool).get(timeout=T)
    assert pool.apply(sqr, (3,)) == 9


# -- Fiber: exceptions, pickling ---------------------------------------------------------


def _assert_remote(exc: BaseException) -> None:
    assert type(exc) is RuntimeError
    assert str(exc) == "task failed on 5"
    cause = exc.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "task_that_raises" in str(cause)
    assert 'raise RuntimeError(f"task failed on {x}")  # the raising line' in str(cause)


def test_exception_carries_the_remote_traceback(pool: Pool) -> None:
    with pytest.raises(RuntimeError) as info:
        pool.apply(task_that_raises, (5,))
    _assert_remote(info.value)

    with pytest.raises(RuntimeError) as info:
        pool.map(task_that_raises, range(10), chunksize=3)
    _assert_remote(info.value)

    errors: list[BaseException] = []
    res = pool.map_async(task_that_raises, range(10), error_callback=errors.append)
    with pytest.raises(RuntimeError):
        res.get(timeout=T)
    assert len(errors) == 1
    _assert_remote(errors[0])

    it = pool.imap(task_that_raises, [5])
    with pytest.raises(RuntimeError) as info:
        it.next(timeout=T)
    _assert_remote(info.value)


def test_unpicklable_arguments_fail_at_once(pool: Pool) -> None:
    lock = threading.Lock()
    assert issubclass(PicklingError, TypeError)
    with pytest.raises(PicklingError, match="lock"):
        pool.map(identity, [1, lock])
    with pytest.raises(PicklingError, match="lock"):
        pool.map_async(identity, [1, 2, lock])
    with pytest.raises(PicklingError, match="lock"):
        pool.apply_async(identity, (lock,))
    with pytest.raises(PicklingError, match="lock"):
        pool.apply_async(identity, (), {"x": lock})
    with pytest.raises(PicklingError, match="lock"):
        pool.starmap_async(mul, [(1, lock)])
    with pytest.raises(PicklingError):
        pool.apply_async(lambda: lock)  # a closure over an unpicklable object
    with pytest.raises(PicklingError):
        pool.map_async(lambda x: lock, [1])
    with pytest.raises(PicklingError):
        pool.imap(lambda x: lock, [1])
    with pytest.raises(PicklingError):
        pool.imap_unordered(lambda x: lock, [1])
    # imap reads its input lazily: the error comes at that position
    it = pool.imap(identity, [1, lock, 3])
    assert it.next(timeout=T) == 1
    with pytest.raises(PicklingError):
        it.next(timeout=T)
    # nothing half-submitted is left behind
    assert pool.map(sqr, range(5)) == [0, 1, 4, 9, 16]


def test_unpicklable_result_is_an_error_not_a_hang(pool: Pool) -> None:
    with pytest.raises(MaybeEncodingError) as info:
        pool.apply_async(return_lock).get(timeout=T)
    assert info.value.exc and info.value.value
    assert "lock" in str(info.value)
    with pytest.raises(MaybeEncodingError):
        pool.map_async(functools.partial(return_lock_on, bad=3), range(6)).get(timeout=T)
    with pytest.raises(MaybeEncodingError):
        pool.apply_async(raise_with_lock).get(timeout=T)
    it = pool.imap(functools.partial(return_lock_on, bad=1), range(3))
    assert it.next(timeout=T) == 0
    with pytest.raises(MaybeEncodingError):
        it.next(timeout=T)
    assert it.next(timeout=T) == 2
    assert pool.map(sqr, range(5)) == [0, 1, 4, 9, 16]


def test_result_that_cannot_be_unpickled_fails_its_task_not_the_pool(pool: Pool) -> None:
    with pytest.raises(FiberError, match="NeedsTwoArgs|unpickl"):
        pool.apply_async(raise_needs_two_args).get(timeout=T)
    assert pool.apply_async(sqr, (4,)).get(timeout=T) == 16
    assert pool.map(sqr, range(20)) == [x * x for x in range(20)]


# -- Fiber: worker deaths ------------------------------------------------------------


@pytest.mark.timeout(120)
def test_map_survives_random_sigkills() -> None:
    """SIGKILL random workers while a 10,000-task map runs: every result arrives, in order."""
    n = 10_000
    marks = frozenset(range(250, n, 500))  # 20 kills, spread over the map
    reports, acks = fiber_core.Queue(), fiber_core.Queue()
    rng = random.Random(1234)
    killed: set[int] = set()
    failures: list[BaseException] = []

    def killer(pool: Pool) -> None:
        # Each report comes from a task that waits for the ack: so every kill happens
        # while the map is still running, and never hits the reporting worker.
        try:
            while True:
                reporter = reports.get(timeout=2 * T)
                if reporter is None:
                    return
                kill_random_worker(pool, rng, killed, also_spare=frozenset({reporter}))
                acks.put(None)
        except BaseException as e:
            failures.append(e)

    with Pool(3) as pool:
        thread = threading.Thread(target=killer, args=(pool,), daemon=True)
        thread.start()
        res = pool.map_async(functools.partial(report_at, marks=marks, reports=reports,
                                               acks=acks), range(n))
        try:
            out = res.get(timeout=4 * T)
        finally:
            reports.put(None)
            thread.join(T)
        assert not failures
        assert len(out) == n
        assert out == list(range(n))
        assert len(killed) >= len(marks)  # one kill per report (a retried mark reports again)
        # the pool replaced them and still works
        assert pool.map(sqr, range(10)) == [x * x for x in range(10)]


@pytest.mark.timeout(120)
def test_imap_unordered_survives_random_sigkills() -> None:
    n = 3000
    rng = random.Random(4321)
    seen: list[int] = []
    killed: set[int] = set()
    with Pool(3) as pool:
        it = pool.imap_unordered(one_ms, range(n))
        for i in range(n):
            seen.append(it.next(timeout=T))
            if i % 200 == 100:  # the kill schedule follows progress
                kill_random_worker(pool, rng, killed)
        with pytest.raises(StopIteration):
            it.next(timeout=T)
        assert len(killed) == 15
        assert len(seen) == n
        assert sorted(seen) == list(range(n))  # each result exactly once


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_task_that_kills_its_worker_is_failed_after_bounded_attempts(how: str,
                                                                     tmp_path: Path) -> None:
    record = tmp_path / "runs"
    task = functools.partial(die_on, bad=5, how=how, record=str(record))
    with Pool(2) as pool:
        # warm up, so that batches hold several tasks
        assert pool.map(sqr, range(100)) == [x * x for x in range(100)]
        results = [pool.apply_async(task, (i,)) for i in range(12)]
        for i, r in enumerate(results):
            if i == 5:
                with pytest.raises(FiberError, match="task lost"):
                    r.get(timeout=T)
            else:
                assert r.get(timeout=T) == i
        # once in a batch not watched (uncharged), then watched until its budget is spent:
        # task_losses, or for a SIGKILL known not to be an OOM kill, MAX_TASK_KILLS
        budget = MAX_TASK_KILLS if how == "sigkill" and oom_kills() is not None else MAX_TASK_ATTEMPTS
        assert record.read_text().count("ran") == budget + 1

        # in a map: the map fails once, through error_callback, never hangs
        errors: list[BaseException] = []
        res = pool.map_async(task, range(12), error_callback=errors.append)
        with pytest.raises(FiberError, match="task lost"):
            res.get(timeout=T)
        assert len(errors) == 1

        # in imap: every other result is there, the lost one raises at its position
        it = pool.imap(task, range(12))
        for i in range(12):
            if i == 5:
                with pytest.raises(FiberError, match="task lost"):
                    it.next(timeout=T)
            else:
                assert it.next(timeout=T) == i

        assert pool.map(sqr, range(10)) == [x * x for x in range(10)]


def test_worker_failing_in_initializer_fails_the_pool() -> None:
    pool = Pool(2, initializer=failing_initializer)
    try:
        with pytest.raises(JobStartError) as info:
            # submitting may already fail, if the pool has given up by then
            pool.map_async(sqr, range(10)).get(timeout=T)
        err = info.value
        assert err.exitcode == 1
        message = str(err)
        assert "fiber_no_such_module_for_this_test" in message  # the initializer's traceback
        assert "failing_initializer" in message
        assert "ModuleNotFoundError" in err.logs
        # it has given up: no retrying in the background, new work is refused at once
        with pytest.raises(JobStartError):
            pool.apply_async(sqr, (1,))
        wait_until(lambda: not any(p.is_alive() for p in pool._pool), "no worker is alive")
    finally:
        pool.terminate()


def killing_initializer() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # as an out-of-memory kill while loading a model


def test_workers_killed_before_they_are_ready_fail_the_pool_too() -> None:
    pool = Pool(2, initializer=killing_initializer)
    try:
        with pytest.raises(JobStartError) as info:
            pool.map_async(sqr, range(4)).get(timeout=T)  # not restarted forever
        assert info.value.exitcode == -signal.SIGKILL
    finally:
        pool.terminate()


def test_terminate_from_a_callback_returns() -> None:
    pool = Pool(1)
    returned = threading.Event()

    def stop(_value: object) -> None:
        pool.terminate()  # runs in the pool's master thread
        returned.set()

    pool.apply_async(sqr, (3,), callback=stop)
    assert returned.wait(T)
    pool.join()


def test_worker_python_that_cannot_start_fails_the_pool(tmp_path: Path) -> None:
    python = tmp_path / "broken-python"
    python.write_text("#!/bin/sh\necho 'fiber-test: this python is broken' >&2\nexit 3\n")
    python.chmod(0o755)
    fiber_core.init(python=str(python))
    pool = Pool(2)
    try:
        with pytest.raises(JobStartError) as info:
            pool.map_async(sqr, range(10)).get(timeout=T)
        assert info.value.exitcode == 3
        assert "this python is broken" in str(info.value)
    finally:
        pool.terminate()


def test_worker_python_that_does_not_exist_fails_at_once(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-python"
    fiber_core.init(python=str(missing))
    with pytest.raises(BackendError, match="no-such-python"):
        Pool(2)


def test_terminate_leaves_no_worker_and_fails_outstanding_results() -> None:
    gate, started = fiber_core.Queue(), fiber_core.Queue()
    pool = Pool(2)
    results = [pool.apply_async(gated, (i, gate, started)) for i in range(4)]
    big = pool.map_async(sqr, range(10_000), chunksize=1)
    assert {started.get(timeout=T), started.get(timeout=T)} <= {0, 1, 2, 3}
    workers = list(pool._pool)
    pids = [w.pid for w in workers]
    assert len(pids) == 2 and None not in pids
    pool.terminate()
    for pid in pids:
        wait_until(lambda pid=pid: pid_gone(pid), f"worker {pid} is gone")
    assert all(w.exitcode is not None for w in workers)
    for r in [*results, big]:
        with pytest.raises(FiberError) as info:
            r.get(timeout=T)
        assert not isinstance(info.value, fiber_core.TimeoutError)
    pool.terminate()  # idempotent
    pool.join()


# -- Fiber: resize, late workers ---------------------------------------------------------


@pytest.mark.timeout(120)
def test_resize_grow_then_shrink_while_a_map_runs() -> None:
    n = 3000
    reports = fiber_core.Queue()
    pool = Pool(2)
    try:
        res = pool.map_async(functools.partial(report_at, marks=frozenset({300, 1500}),
                                               reports=reports), range(n))
        reports.get(timeout=T)  # the map is under way
        pool.resize(4)
        assert len(pool._pool) == 4
        reports.get(timeout=T)  # and further along
        pool.resize(1)
        assert res.get(timeout=2 * T) == list(range(n))  # each result once, in order
        wait_until(lambda: len([p for p in pool._pool if p.is_alive()]) == 1,
                   "one worker is left")
        assert len(pool._pool) == 1
        assert pool.map(sqr, range(20)) == [x * x for x in range(20)]
        pool.resize(2)
        assert pool.map(sqr, range(20)) == [x * x for x in range(20)]
        assert len(pool._pool) == 2
        with pytest.raises(ValueError):
            pool.resize(0)
    finally:
        pool.terminate()


def test_work_starts_before_all_workers_are_up() -> None:
    tickets = fiber_core.Queue()
    tickets.put(None)  # one worker of three may finish starting
    pool = Pool(3, initializer=take_ticket, initargs=(tickets,))
    try:
        assert pool.map(sqr, range(20)) == [x * x for x in range(20)]
        # the results came while two workers were still in their initializer
        assert len(pool._workers) == 3
        assert sum(w.ready for w in pool._workers.values()) == 1

        pool.resize(4)  # the new worker waits for a ticket too
        assert pool.apply_async(sqr, (9,)).get(timeout=T) == 81
        assert sum(w.ready for w in pool._workers.values()) == 1

        for _ in range(3):
            tickets.put(None)
        wait_until(lambda: sum(w.ready for w in pool._workers.values()) == 4,
                   "every worker is ready")
        assert pool.map(sqr, range(20)) == [x * x for x in range(20)]
    finally:
        pool.terminate()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


def test_a_short_task_is_not_sent_behind_a_task_of_unknown_length() -> None:
    """A task queued while the only worker runs a task of unknown length waits in the pool,
    not in that worker's socket: a worker that becomes ready meanwhile runs it."""
    with Pool(1) as pool:
        assert pool.map(sqr, range(20)) == [x * x for x in range(20)]  # sqr's time is known: tiny
        gate, started = fiber_core.Queue(), fiber_core.Queue()
        held = pool.apply_async(gated, (1, gate, started))
        assert started.get(timeout=T) == 1
        quick = pool.apply_async(sqr, (3,))
        pool.resize(2)
        assert quick.get(timeout=T) == 9  # on the new worker, while the first is held
        gate.put(None)
        assert held.get(timeout=T) == 1


def test_a_pool_worker_loads_the_worker_side_of_the_pool_only() -> None:
    with Pool(1) as pool:
        loaded = set(pool.apply(pool_modules, (0,)))
    assert "fiber_core.parallel.pool.worker" in loaded
    master_side = {f"fiber_core.parallel.pool.{m}" for m in
                   ("facade", "master", "events", "dispatch", "table", "results", "planner", "ledger")}
    assert not loaded & master_side, loaded
