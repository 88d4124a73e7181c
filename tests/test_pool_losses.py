"""How a ``Pool`` accounts for lost workers: only the task that was running is charged.

Real workers on the local backend, killed for real (``os._exit``, SIGKILL, SIGTERM);
nothing is mocked. Tasks that kill their worker once leave a marker file per item
in a temporary directory that the test removes. ``T`` bounds every wait: reaching
it is a failure, never a measure of speed.
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError
from pathlib import Path

import pytest
from chaos import Chaos
from procs import wait_gone, wait_until

import fiber_core
from fiber_core.base.errors import (
    BackendError,
    DeadlineError,
    TaskExitError,
    TaskLostError,
    TimeoutError,
)
from fiber_core.base.oom import oom_kills
from fiber_core.parallel.pool import MAX_TASK_ATTEMPTS, Pool
from fiber_core.parallel.pool.ledger import MAX_TASK_KILLS
from fiber_core.testing.faults import FaultSchedule, chaos_seed

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed


# -- tasks (module level: workers import this module to find them) -----------------------


def sqr(x: int) -> int:
    return x * x


def exit_once_at(x: int, marks: frozenset[int], where: str) -> int:
    """Return ``x``; an item in ``marks`` kills its worker (``os._exit``) the first time it runs."""
    if x in marks:
        try:
            fd = os.open(os.path.join(where, f"{x}.ran"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return x  # it killed a worker already
        os.close(fd)
        os._exit(1)
    return x


def exit_always_at(x: int, bad: int, where: str) -> int:
    """Return ``x``; item ``bad`` kills every worker that runs it, counting its runs."""
    if x == bad:
        fd = os.open(os.path.join(where, "runs"), os.O_CREAT | os.O_APPEND | os.O_WRONLY)
        os.write(fd, b"ran\n")
        os.close(fd)
        os._exit(1)
    return x


def ends_at(x: int, bad: int, how: str, where: str) -> int:
    """Item ``bad`` ends its worker's work in the way ``how`` names, counting its runs."""
    if x == bad:
        fd = os.open(os.path.join(where, "runs"), os.O_CREAT | os.O_APPEND | os.O_WRONLY)
        os.write(fd, b"ran\n")
        os.close(fd)
        if how == "sys.exit":
            sys.exit(3)
        if how == "KeyboardInterrupt":
            raise KeyboardInterrupt
        if how == "os._exit":
            os._exit(3)
    return x


class Unloadable:
    """An argument that pickles in the caller and cannot be unpickled in a worker."""

    def __reduce__(self) -> tuple:
        return (_refuse, ("made to fail in the worker",))


def _refuse(why: str) -> None:
    if fiber_core.current_process().name.startswith("PoolWorker"):
        raise ValueError(why)


def raise_until(x: int, where: str, fails: int) -> int:
    """Raise the first ``fails`` times it runs, then return ``x`` (an idempotent task)."""
    path = os.path.join(where, f"{x}.tries")
    with open(path, "a") as f:
        f.write("x")
    if os.path.getsize(path) <= fails:
        raise RuntimeError(f"attempt {os.path.getsize(path)} of {x} failed")
    return x


def gated(x: int, gate: fiber_core.Queue, started: fiber_core.Queue) -> int:
    """Tell ``started`` this task runs (and where), then wait until the test opens ``gate``."""
    started.put((x, os.getpid()))
    gate.get(timeout=T)
    return x


def recorded(x: int, where: str) -> int:
    """~50 ms of work between a start and an end marker file (too long to be prefetched)."""
    Path(where, f"{x}.start").touch()
    time.sleep(0.05)  # the work itself, not synchronisation
    Path(where, f"{x}.end").touch()
    return x


def stuck_once_at(x: int, bad: int, where: str, gate: fiber_core.Queue) -> int:
    """Item ``bad`` hangs the first time it runs (until ``gate`` opens): a straggler."""
    time.sleep(0.002)  # the work itself, not synchronisation
    if x == bad:
        try:
            fd = os.open(os.path.join(where, "stuck"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return x  # the backup copy
        os.close(fd)
        gate.get(timeout=4 * T)
    return x


def hang_at(x: int, bad: frozenset[int], gate: fiber_core.Queue) -> int:
    """Items in ``bad`` wait until the test opens ``gate``; the others return at once."""
    if x in bad:
        gate.get(timeout=4 * T)
    return x


def kill_self_at(x: int, bad: int, where: str) -> int:
    """Item ``bad`` SIGKILLs its own worker every time it runs, counting its runs."""
    if x == bad:
        fd = os.open(os.path.join(where, "runs"), os.O_CREAT | os.O_APPEND | os.O_WRONLY)
        os.write(fd, b"ran\n")
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def wait_for(gate: fiber_core.Queue) -> None:
    """An initializer that holds its worker in its start until the test opens ``gate``."""
    gate.get(timeout=4 * T)


def cpu_task(x: int) -> int:
    """1-5 ms of CPU (not of sleep): eight workers on a few CPUs stretch each to ~10 ms."""
    end = time.thread_time() + 0.001 + (x % 5) * 0.001
    while time.thread_time() < end:
        pass
    return x


def ms_task(x: int) -> int:
    time.sleep(0.001 + (x % 5) * 0.001)  # the work itself (1-5 ms), not synchronisation
    return x


# -- helpers -------------------------------------------------------------------------



# -- only the running task is charged -------------------------------------------------


@pytest.mark.timeout(180)
def test_items_that_kill_their_worker_once_do_not_fail_the_map() -> None:
    """8 of 2,000 items each kill their worker once: the map succeeds, every result once."""
    n = 2000
    marks = frozenset(range(111, n, 250))  # 8 items
    assert len(marks) == 8
    with tempfile.TemporaryDirectory() as where, Pool(4) as pool:
        out = pool.map(functools.partial(exit_once_at, marks=marks, where=where), range(n))
        assert out == list(range(n))
        assert sorted(Path(where).iterdir()) == sorted(Path(where, f"{x}.ran") for x in marks)
        # and so does imap, where each item is its own unit
        for x in marks:
            os.unlink(os.path.join(where, f"{x}.ran"))
        it = pool.imap(functools.partial(exit_once_at, marks=marks, where=where), range(n))
        assert list(it) == list(range(n))


def test_deaths_while_different_items_of_one_unit_ran_fail_none_of_them() -> None:
    """Three deaths of the workers running one unit of ten items, each at another item: no
    item was running at more than one, so nothing fails (charged per unit, it would)."""
    marks = frozenset({3, 5, 7})
    with tempfile.TemporaryDirectory() as where, Pool(2) as pool:
        task = functools.partial(exit_once_at, marks=marks, where=where)
        assert pool.map(task, range(10), chunksize=10) == list(range(10))
        assert sorted(Path(where).iterdir()) == sorted(Path(where, f"{x}.ran") for x in marks)


@pytest.mark.timeout(120)
def test_an_item_that_kills_every_worker_fails_the_map_with_that_item_named() -> None:
    n = 2000
    with tempfile.TemporaryDirectory() as where, Pool(4) as pool:
        res = pool.map_async(functools.partial(exit_always_at, bad=1234, where=where), range(n))
        with pytest.raises(TaskLostError, match=r"item 1234 of map\(exit_always_at\)") as info:
            res.get(timeout=4 * T)
        assert "exited with code 1" in str(info.value)
        runs = Path(where, "runs").read_text().count("ran")
        # the first run was in a batch not watched: uncharged; then it ran alone, watched
        assert runs == MAX_TASK_ATTEMPTS + 1
        assert pool.map(sqr, range(10)) == [x * x for x in range(10)]


def test_task_losses_bounds_the_charged_deaths() -> None:
    with tempfile.TemporaryDirectory() as where, Pool(2, task_losses=1) as pool:
        res = pool.apply_async(exit_always_at, (5, 5, where))
        with pytest.raises(TaskLostError, match=r"apply_async\(exit_always_at, \(5, 5, "):
            res.get(timeout=T)
        # once not watched (no item is known to have started: uncharged), once watched
        assert Path(where, "runs").read_text().count("ran") == 2
    with pytest.raises(ValueError, match="task_losses"):
        Pool(1, task_losses=0)
    with pytest.raises(ValueError, match="loss_limit"):
        Pool(1, loss_limit=(0, 10))


def test_a_task_that_sigkills_its_own_worker_fails_after_its_budget_named() -> None:
    # Where the cgroup counts OOM kills, its SIGKILL is known not to be one: it draws on
    # MAX_TASK_KILLS; elsewhere it may be an OOM kill, and draws on task_losses. Its first
    # run is not watched (no item of that batch is known to have started): not charged.
    known = oom_kills() is not None
    runs_allowed = (MAX_TASK_KILLS if known else MAX_TASK_ATTEMPTS) + 1
    with tempfile.TemporaryDirectory() as where, Pool(2) as pool:
        task = functools.partial(kill_self_at, bad=5, where=where)
        with pytest.raises(TaskLostError, match=r"task lost: item 5 of map\(kill_self_at\)") as info:
            pool.map_async(task, range(10)).get(timeout=4 * T)
        if known:
            assert f"killed by SIGKILL {MAX_TASK_KILLS} times while running it" in str(info.value)
        assert Path(where, "runs").read_text().count("ran") == runs_allowed
        assert pool.map(sqr, range(4)) == [0, 1, 4, 9]


def _starting_pid(pool: Pool, skip: list[int]) -> int | None:
    with pool._lock:
        for w in pool._workers.values():
            if not w.ready and not w.lost and w.process.pid is not None and w.process.pid not in skip:
                return w.process.pid
    return None


def test_an_item_whose_worker_is_killed_while_starting_three_times_is_not_failed() -> None:
    gate = fiber_core.Queue()
    killed: list[int] = []
    with Pool(1, initializer=wait_for, initargs=(gate,)) as pool:
        res = pool.apply_async(sqr, (7,))  # waits for the one worker, which is starting
        for _ in range(3):
            wait_until(lambda: _starting_pid(pool, killed) is not None, "a worker is starting")
            pid = _starting_pid(pool, killed)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            wait_gone(pid)
        assert not res.ready()
        gate.put(None)  # the fourth worker starts
        assert res.get(timeout=T) == 49
        assert pool._error is None


# -- the pool-wide limit on losses that are no task's fault ---------------------------


def test_workers_killed_while_starting_are_not_taken_for_a_broken_image() -> None:
    """SIGKILL every worker before it connects, many times: the pool still comes up."""
    stop = threading.Event()
    killed: set[int] = set()

    with Pool(2) as pool:

        def kill_starting() -> None:
            while not stop.is_set() and len(killed) < 25:
                with pool._lock:
                    for w in list(pool._workers.values()):
                        pid = w.process.pid
                        if w.conn is None and pid is not None and pid not in killed:
                            killed.add(pid)
                            try:
                                os.kill(pid, signal.SIGKILL)
                            except ProcessLookupError:
                                pass
                stop.wait(0.001)

        thread = threading.Thread(target=kill_starting, daemon=True)
        thread.start()
        try:
            wait_until(lambda: len(killed) >= 25 or not thread.is_alive(), "25 kills")
        finally:
            stop.set()
            thread.join(T)
        assert len(killed) >= 25  # more than MAX_START_KILLS in a row
        assert pool.map(sqr, range(20)) == [x * x for x in range(20)]


def test_losses_past_the_limit_fail_the_pool_clearly() -> None:
    with Pool(2, loss_limit=(3, 600.0)) as pool:
        assert pool.map(sqr, range(4)) == [0, 1, 4, 9]
        res = pool.map_async(ms_task, range(100_000))
        for _ in range(4):
            with pool._lock:
                victims = [w for w in pool._workers.values() if not w.lost and w.process.pid]
            for w in victims:
                if w.process.pid:
                    os.kill(w.process.pid, signal.SIGTERM)  # the polite stop of a preemption
            wait_until(lambda gone=victims: pool._error is not None or all(w.lost for w in gone),
                       "the stopped workers are gone")
            if pool._error is not None:
                break
        with pytest.raises(BackendError, match=r"lost 4 times within 600 s.*loss_limit"):
            res.get(timeout=T)


# -- a task's own ending is its error, after one run -------------------------------------


@pytest.mark.parametrize("how,match", [
    ("sys.exit", r"item 5 of map\(ends_at\) called sys.exit\(3\)"),
    ("KeyboardInterrupt", r"item 5 of map\(ends_at\) was interrupted"),
])
def test_a_task_ending_its_worker_is_its_own_error_after_one_run(how: str, match: str) -> None:
    with tempfile.TemporaryDirectory() as where, Pool(2) as pool:
        task = functools.partial(ends_at, bad=5, how=how, where=where)
        with pytest.raises(TaskExitError, match=match):
            pool.map(task, range(10), chunksize=1)
        assert Path(where, "runs").read_text().count("ran") == 1
        assert pool.map(sqr, range(4)) == [0, 1, 4, 9]  # the workers lived on


def test_an_argument_that_cannot_be_unpickled_in_the_worker_is_its_own_error() -> None:
    with Pool(2) as pool:
        res = pool.apply_async(sqr, (Unloadable(),))
        with pytest.raises(TaskExitError, match=r"apply_async\(sqr, .*cannot be unpickled in the "
                                                r"worker: ValueError\('made to fail in the worker'"):
            res.get(timeout=T)
        assert pool.apply(sqr, (3,)) == 9


def test_os_exit_in_a_task_stays_a_charged_loss() -> None:
    with tempfile.TemporaryDirectory() as where, Pool(2) as pool:
        task = functools.partial(ends_at, bad=5, how="os._exit", where=where)
        with pytest.raises(TaskLostError, match=r"item 5 of imap\(ends_at\).*exited with code 3"):
            list(pool.imap(task, range(10)))
        runs = Path(where, "runs").read_text().count("ran")
        assert runs == MAX_TASK_ATTEMPTS + 1  # + 1: its first run, not watched, is not charged


# -- retrying tasks that raise: an opt-in ----------------------------------------------


def test_a_raising_task_is_not_retried_unless_asked() -> None:
    with tempfile.TemporaryDirectory() as where, Pool(2) as pool:
        with pytest.raises(RuntimeError, match="attempt 1 of 3"):
            pool.apply(raise_until, (3, where, 2))
        # per call
        assert pool.apply(raise_until, (4, where, 2), retries=2) == 4
        assert pool.map(functools.partial(raise_until, where=where, fails=1), [10, 11],
                        retries=1) == [10, 11]
        with pytest.raises(RuntimeError, match="attempt 2 of 12"):
            pool.map(functools.partial(raise_until, where=where, fails=2), [12], retries=1)
    with tempfile.TemporaryDirectory() as where, Pool(2, retries=1) as pool:  # per pool
        assert list(pool.imap(functools.partial(raise_until, where=where, fails=1), [1, 2])) == [1, 2]
    with pytest.raises(ValueError, match="retries"):
        Pool(1, retries=-1)


# -- draining: a worker sent SIGTERM hands its work back ---------------------------------


def test_a_worker_sent_sigterm_finishes_its_task_and_takes_no_other() -> None:
    gate, started = fiber_core.Queue(), fiber_core.Queue()
    with Pool(1) as pool:
        held = pool.apply_async(gated, (1, gate, started))
        _, pid = started.get(timeout=T)
        (process,) = [p for p in pool._pool if p.pid == pid]
        os.kill(pid, signal.SIGTERM)
        # A replacement starts at once and takes new work while the first still runs its task.
        assert pool.apply_async(os.getpid).get(timeout=T) != pid
        assert Path(f"/proc/{pid}").exists() and not held.ready()
        gate.put(None)
        assert held.get(timeout=T) == 1  # finished where it ran, within the grace period
        process.join(T)
        assert process.exitcode == 0  # it left when told to, not killed after the grace period
        assert started.empty()  # it ran once
        assert pool.map(sqr, range(8)) == [x * x for x in range(8)]


def test_an_idle_worker_sent_sigterm_is_replaced() -> None:
    with Pool(2) as pool:
        pids = set(pool.map(_pid, range(200)))
        assert pids
        victim = next(iter(pids))
        os.kill(victim, signal.SIGTERM)
        wait_until(lambda: not Path(f"/proc/{victim}").exists() or _zombie(victim), "it exited")
        assert pool.map(sqr, range(8)) == [x * x for x in range(8)]


def _pid(x: int) -> int:
    return os.getpid()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    except OSError:
        return True


def _not_draining(pool: Pool) -> Callable[[], list[int]]:
    def pids() -> list[int]:
        with pool._lock:
            return [w.process.pid for _, w in sorted(pool._workers.items())
                    if not w.lost and not w.draining and w.process.pid is not None]
    return pids


@pytest.mark.timeout(300)
def test_sigterm_chaos_charges_no_task_and_runs_each_once() -> None:
    """A worker of Pool(8) sent SIGTERM at 40 points of the run that a seed draws
    (FIBER_CHAOS_SEED replays them): every result exactly once."""
    n = 10_000
    schedule = FaultSchedule.spread(chaos_seed(), results=n, count=40, kinds=("term",))
    with Pool(8, task_losses=1) as pool:  # a single charged death would fail the run
        with Chaos(pool, schedule, _not_draining(pool)) as chaos:
            out = sorted(pool.imap_unordered(ms_task, range(n), chunksize=4))
        assert out == list(range(n)), chaos  # a batch handed back and also run would show twice
        assert chaos.struck, chaos


# -- a backend that refuses new jobs for a while ----------------------------------------


def test_replacements_wait_for_a_backend_that_refuses_for_a_while(
        caplog: pytest.LogCaptureFixture) -> None:
    """The worker python vanishes (as a daemon that restarts): replacements wait for it."""
    with tempfile.TemporaryDirectory() as where:
        python = Path(where, "python")
        # A wrapper, not a link: a link outside the venv would not find its packages.
        wrapper = Path(where, "python-wrapper")
        wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        wrapper.chmod(0o755)
        python.symlink_to(wrapper)
        fiber_core.init(python=str(python))
        with Pool(2) as pool:
            assert pool.map(sqr, range(10)) == [x * x for x in range(10)]
            python.unlink()  # every start is refused from now on
            for p in pool._pool:
                if p.pid is not None:
                    os.kill(p.pid, signal.SIGKILL)
            res = pool.map_async(sqr, range(50))
            wait_until(lambda: "waiting for the backend" in caplog.text, "the pool says it waits")
            assert not res.ready() and pool._error is None
            python.symlink_to(wrapper)  # back
            assert res.get(timeout=T) == [x * x for x in range(50)]
        assert "cannot start" in caplog.text


# -- backup tasks ------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["map", "imap"])
def test_a_backup_copy_finishes_a_call_that_a_straggler_holds(api: str) -> None:
    gate = fiber_core.Queue()
    with tempfile.TemporaryDirectory() as where, Pool(3, backup=True) as pool:
        task = functools.partial(stuck_once_at, bad=150, where=where, gate=gate)
        try:
            if api == "map":
                out = pool.map_async(task, range(200)).get(timeout=2 * T)
            else:
                out = list(pool.imap(task, range(200)))
            assert out == list(range(200))  # once each: the straggler is still stuck
            assert Path(where, "stuck").exists()
        finally:
            gate.put(None)
        assert pool.map(sqr, range(8)) == [x * x for x in range(8)]
    with pytest.raises(ValueError, match="backup"):
        Pool(1, backup=0.5)


# -- deadlines ----------------------------------------------------------------------------


def test_a_call_past_its_deadline_is_cancelled_with_what_finished() -> None:
    gate = fiber_core.Queue()
    bad = frozenset({3, 7})
    task = functools.partial(hang_at, bad=bad, gate=gate)
    # A pool per case: tasks stuck in one case would hold workers (and what they prefetched).
    try:
        with Pool(3) as pool:
            with pytest.raises(DeadlineError, match=r"map\(hang_at\): its deadline of 1 s passed "
                                                    r"with \d+ of 10 tasks finished") as info:
                pool.map(task, range(10), chunksize=1, deadline=1.0)
            results = info.value.results
            assert len(results) == 10 and all(r in (None, x) for x, r in enumerate(results))
            assert results[3] is None and results[7] is None
            assert info.value.done == sum(r is not None for r in results)
            assert info.value.total == 10
            assert isinstance(info.value, TimeoutError)
        with Pool(3) as pool:
            assert pool.map(sqr, range(3), chunksize=1) == [0, 1, 4]  # every worker up
            # The first units of a function not timed yet go one per batch: 3 waits alone.
            it = pool.imap(functools.partial(hang_at, bad=frozenset({3}), gate=gate), range(4),
                           deadline=3.0)
            assert [next(it) for _ in range(3)] == [0, 1, 2]
            with pytest.raises(DeadlineError, match=r"imap\(hang_at\)"):
                next(it)
            with pytest.raises(StopIteration):
                next(it)
        with Pool(1) as pool:
            with pytest.raises(DeadlineError, match=r"apply_async\(hang_at\): its deadline"):
                pool.apply(task, (3,), deadline=0.5)
        with Pool(2) as pool:
            assert pool.map(sqr, range(8), deadline=T) == [x * x for x in range(8)]  # not hit
            with pytest.raises(ValueError, match="deadline"):
                pool.map(sqr, [1], deadline=0)
    finally:
        for _ in range(6):
            gate.put(None)


# -- cancellation ------------------------------------------------------------------------


def _count(where: str, suffix: str) -> int:
    return sum(1 for p in Path(where).iterdir() if p.name.endswith(suffix))


@pytest.mark.parametrize("chunksize", [1, 3])
def test_closing_an_imap_unordered_starts_none_of_its_other_tasks(chunksize: int) -> None:
    n, k = 200, 6
    with tempfile.TemporaryDirectory() as where, Pool(2) as pool:
        it = pool.imap_unordered(functools.partial(recorded, where=where), range(n), chunksize)
        first = list(itertools.islice(it, k))
        assert len(first) == k
        it.close()
        # Whatever runs now started before close(): at most one unit per worker.
        ended = _count(where, ".end")
        bound = ended + 2 * chunksize
        with pytest.raises(StopIteration):
            next(it)
        assert it.call_id not in pool._calls  # the pool is free
        assert pool.map(sqr, range(8)) == [x * x for x in range(8)]
        wait_until(lambda: _count(where, ".start") == _count(where, ".end"), "running tasks end")
        assert _count(where, ".start") <= bound < n


def test_cancelling_an_async_result_starts_none_of_its_other_tasks() -> None:
    n = 200
    with tempfile.TemporaryDirectory() as where, Pool(2) as pool:
        res = pool.map_async(functools.partial(recorded, where=where), range(n), chunksize=1)
        wait_until(lambda: _count(where, ".end") >= 4, "some tasks ran")
        assert res.cancel()
        bound = _count(where, ".end") + 2
        assert res.cancelled() and res.ready() and not res.successful()
        with pytest.raises(CancelledError):
            res.get(timeout=T)
        assert not res.cancel()  # ready already
        assert pool.map(sqr, range(8)) == [x * x for x in range(8)]
        wait_until(lambda: _count(where, ".start") == _count(where, ".end"), "running tasks end")
        assert _count(where, ".start") <= bound < n
        done = pool.apply_async(sqr, (3,))
        assert done.get(timeout=T) == 9 and not done.cancel()


# -- chaos: a random worker SIGKILLed every 0.1-0.3 s --------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("api", ["map", "imap", "imap_unordered", "apply_async"])
def test_chaos_every_result_exactly_once(api: str) -> None:
    """A worker of Pool(8) SIGKILLed at 60 points of a run of 1-5 ms tasks that a seed draws
    (FIBER_CHAOS_SEED replays them)."""
    n = 10_000
    with Pool(8) as pool:
        assert pool.map(sqr, range(8)) == [x * x for x in range(8)]
        schedule = FaultSchedule.spread(chaos_seed(), results=n, count=60, kinds=("kill",),
                                        first=8, last=8 + n - 1)  # (the 8 above count)
        with Chaos(pool, schedule) as chaos:
            if api == "map":
                out = pool.map_async(ms_task, range(n)).get(timeout=8 * T)
            elif api == "imap":
                out = list(pool.imap(ms_task, range(n)))
            elif api == "imap_unordered":
                out = sorted(pool.imap_unordered(ms_task, range(n)))
            else:
                results = [pool.apply_async(ms_task, (i,)) for i in range(n)]
                out = [r.get(timeout=8 * T) for r in results]
        assert out == list(range(n)), chaos
        assert chaos.struck, chaos  # the chaos happened
        assert pool.map(sqr, range(8)) == [x * x for x in range(8)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", [1, 2])
def test_random_sigkills_charge_no_item_a_death_it_did_not_cause(seed: int) -> None:
    """A new user's map (CPU-bound 1-5 ms items, auto-chunked into units of several):
    deaths land on different items of a unit, or on workers that start or hold work not
    begun, and none of them may add up to a TaskLostError. Any process of ``pool._pool``
    (starting workers too) is SIGKILLed at 30 points that the seed draws."""
    n = 2000
    with Pool(8) as pool:
        assert pool.map(sqr, range(8)) == [x * x for x in range(8)]
        schedule = FaultSchedule.spread(chaos_seed(default=seed), results=n, count=30,
                                        kinds=("kill",), first=8, last=8 + n - 1)
        with Chaos(pool, schedule, lambda: [p.pid for p in pool._pool if p.pid is not None]) as chaos:
            out = pool.map_async(cpu_task, range(n)).get(timeout=8 * T)
        assert out == list(range(n)), chaos
        assert chaos.struck, chaos


class KillsOnLoad:
    """A function that pickles in the caller and kills any pool worker that unpickles it."""

    def __reduce__(self) -> tuple:
        return (_exit_if_worker, ())

    def __call__(self, x: int) -> int:
        return x


def _exit_if_worker() -> KillsOnLoad:
    if fiber_core.current_process().name.startswith("PoolWorker"):
        os._exit(1)
    return KillsOnLoad()


def test_a_function_whose_loading_kills_the_worker_fails_the_call_instead_of_looping() -> None:
    with Pool(2) as pool:
        with pytest.raises(TaskLostError, match=r"item 0 of map\(KillsOnLoad\).*exited with code 1"):
            pool.map_async(KillsOnLoad(), range(4), chunksize=4).get(timeout=2 * T)
        assert pool.map(sqr, range(4)) == [0, 1, 4, 9]
