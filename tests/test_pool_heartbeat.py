"""A frozen pool worker (alive, its socket open, silent) is found by its missing heartbeats.

Real workers on the local backend, frozen for real with SIGSTOP: the kernel still answers
TCP keepalive for them, so only the application's heartbeat can tell. ``T`` bounds every
wait: reaching it is a failure, never a measure of speed.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time

import pytest
from chaos import Chaos, connected
from procs import wait_until

import fiber_core
from fiber_core.base.errors import TaskLostError
from fiber_core.parallel.pool import Pool
from fiber_core.parallel.pool.ledger import MAX_TASK_FREEZES
from fiber_core.runtime.config import config
from fiber_core.testing.faults import FaultSchedule, chaos_seed

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed


def slow_square(x: int) -> int:
    time.sleep(0.2)  # the task's own work
    return x * x


def long_without_the_gil(x: int) -> tuple[int, int]:
    """Longer than the test's bound, in calls that release the GIL; returns its worker's pid."""
    time.sleep(1.5)
    buf = b"x" * (64 << 20)
    for _ in range(8):
        hashlib.sha256(buf).digest()  # C, GIL released on big buffers
    time.sleep(1.5)
    return x, os.getpid()


def freezes_itself(x: int) -> int:
    if x == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    return x


def ms_task(x: int) -> int:
    time.sleep(0.001 + (x % 5) * 0.001)  # the work itself (1-5 ms)
    return x


def _pids(pool: Pool) -> list[int]:
    return [p.pid for p in pool._pool if p.pid is not None]


def test_a_frozen_worker_is_lost_by_default_and_the_map_gives_every_result_once() -> None:
    """Pool(4), 100 tasks of 0.2 s, one worker SIGSTOPped mid-map: with no setting, the map
    ends (within heartbeat_timeout plus the tasks' time) and names why the worker was lost."""
    bound = config.get("heartbeat_timeout")
    assert 10 <= bound <= 20  # the default
    with Pool(4) as pool:
        result = pool.map_async(slow_square, range(100))
        wait_until(lambda: pool.status_snapshot()["tasks"]["done"] >= 8, "the map is under way")
        frozen = _pids(pool)[0]
        os.kill(frozen, signal.SIGSTOP)
        try:
            assert result.get(timeout=bound + 100 * 0.2 + T) == [x * x for x in range(100)]
        finally:
            try:
                os.kill(frozen, signal.SIGCONT)
            except ProcessLookupError:
                pass
        wait_until(lambda: pool.status_snapshot()["losses"].get("unresponsive") == 1,
                   "the loss is counted")
        snap = pool.status_snapshot()
        assert snap["losses"] == {"unresponsive": 1}
        assert "stopped answering" in snap["last_loss"] and "no heartbeat" in snap["last_loss"]
        assert frozen not in _pids(pool)
        assert pool.map(slow_square, range(8)) == [x * x for x in range(8)]  # it goes on, at full size


def test_a_task_longer_than_the_bound_that_releases_the_gil_keeps_its_worker() -> None:
    fiber_core.init(heartbeat_timeout=1.0)
    with Pool(2) as pool:
        before = set(_pids(pool))
        out = pool.map(long_without_the_gil, range(2), chunksize=1)
        assert [x for x, _ in out] == [0, 1]
        assert {pid for _, pid in out} <= before  # run by the workers it started with, once
        snap = pool.status_snapshot()
        assert snap["losses"] == {}
        assert set(_pids(pool)) == before


def test_a_task_that_freezes_its_worker_every_time_fails_named_and_the_others_succeed() -> None:
    fiber_core.init(heartbeat_timeout=0.5)
    with Pool(2) as pool:
        result = pool.map_async(freezes_itself, range(4), chunksize=1)
        with pytest.raises(TaskLostError, match=rf"item 1 of map\(freezes_itself\).*stopped "
                                                rf"answering {MAX_TASK_FREEZES} times"):
            result.get(timeout=4 * T)
        assert pool.map(freezes_itself, [0, 2, 3]) == [0, 2, 3]
        assert pool.status_snapshot()["losses"]["unresponsive"] >= MAX_TASK_FREEZES


def test_each_worker_reports_what_it_uses_to_the_live_view() -> None:
    fiber_core.init(heartbeat_timeout=0.5)  # a heartbeat every 0.1 s
    with Pool(2) as pool:
        assert pool.map(slow_square, range(4)) == [0, 1, 4, 9]
        wait_until(lambda: all(len(w["usage_history"]) >= 3 for w in pool.status_snapshot()["workers"]),
                   "a few heartbeats arrived")
        for w in pool.status_snapshot()["workers"]:
            assert set(w["usage"]) == {"cpu", "rss", "gpu", "gpu_memory"}
            assert w["usage"]["rss"] > 1 << 20
            history = w["usage_history"]
            assert all(len(h) == 3 for h in history)
            ages = [h[0] for h in history]
            assert ages == sorted(ages, reverse=True) and ages[-1] >= 0  # oldest first


def test_with_no_bound_a_worker_sends_no_heartbeat() -> None:
    fiber_core.init(heartbeat_timeout=0)
    with Pool(1) as pool:
        assert pool.map(slow_square, range(3)) == [0, 1, 4]
        assert [w["usage"] for w in pool.status_snapshot()["workers"]] == [None]


@pytest.mark.timeout(300)
def test_workers_frozen_at_seeded_points_lose_no_result_and_run_none_twice_visibly() -> None:
    """Pool(4), 2,000 tasks of 1-5 ms, a worker SIGSTOPped at 5 points a seed draws
    (FIBER_CHAOS_SEED replays them): every result exactly once, each freeze counted."""
    fiber_core.init(heartbeat_timeout=1.0)
    n = 2000
    schedule = FaultSchedule.spread(chaos_seed(), results=n, count=5, kinds=("stop",), last=n - 200)
    with Pool(4) as pool:
        # (only connected workers: one frozen before it connects is start_timeout's to find)
        with Chaos(pool, schedule, connected(pool)) as chaos:
            out = sorted(pool.imap_unordered(ms_task, range(n), chunksize=2))
        assert out == list(range(n)), chaos
        frozen = {pid for _, _, pid in chaos.struck}
        wait_until(lambda: pool.status_snapshot()["losses"].get("unresponsive", 0) == len(frozen),
                   f"each frozen worker is counted ({chaos})")
