"""Elastic pools on the local backend: ``Pool(max, min_processes=..., idle_timeout=...)``
grows to its maximum while work waits, shrinks back to its minimum once idle, and loses
and repeats nothing on the way; the arguments are checked.

The Kubernetes plugin's tests add the platform's side: pods left Pending for want of
room are requests, granted when a node is added.
"""

from __future__ import annotations

import os
from multiprocessing.connection import wait

import pytest

import fiber_core
from fiber_core.parallel.pool import Pool

T = 60.0


def init(barrier, counter) -> None:  # noqa: ANN001
    global _barrier, _counter
    _barrier, _counter = barrier, counter


def meet(x: int) -> int:
    """Returns once every party holds a task at once: the pool has that many workers."""
    _barrier.wait(T)
    return os.getpid()


def counted(x: int) -> int:
    with _counter.get_lock():
        _counter.value += 1
    return x * x


def live(pool: Pool) -> list:
    return [w.process for w in pool._workers.values() if not w.retiring and not w.lost]


def test_grows_to_its_maximum_during_a_map_and_shrinks_back_when_idle() -> None:
    barrier, counter = fiber_core.Barrier(4), fiber_core.Value("i", 0)
    with Pool(4, min_processes=1, idle_timeout=1.0, initializer=init, initargs=(barrier, counter)) as pool:
        assert len(live(pool)) == 1
        # Four tasks that each wait for the other three: done only with four workers at once.
        assert len(set(pool.map(meet, range(4), chunksize=1))) == 4
        grown = live(pool)
        assert len(grown) == 4
        # Meanwhile and after, nothing lost or run twice.
        assert pool.map(counted, range(500)) == [x * x for x in range(500)]
        assert counter.value == 500
        # Idle for idle_timeout: three go (their jobs end), one stays.
        ended = set()
        while len(ended) < 3:
            ready = wait([p.sentinel for p in grown if p.sentinel not in ended], timeout=T)
            assert ready, "idle workers beyond the minimum did not go"
            ended.update(ready)
        assert len(live(pool)) == 1 and sum(p.exitcode == 0 for p in grown) >= 3
        # Work again: it grows again.
        assert len(set(pool.map(meet, range(4), chunksize=1))) == 4


def test_a_pool_with_no_minimum_starts_workers_for_work_and_lets_them_all_go() -> None:
    with Pool(2, min_processes=0, idle_timeout=0.5) as pool:
        assert live(pool) == []
        assert pool.apply(abs, (-3,)) == 3
        workers = live(pool)
        assert workers
        assert wait([p.sentinel for p in workers], timeout=T)
        assert pool.map(abs, range(-5, 0)) == [5, 4, 3, 2, 1]


def test_resize_of_an_elastic_pool_sets_its_maximum() -> None:
    barrier, counter = fiber_core.Barrier(3), fiber_core.Value("i", 0)
    with Pool(2, min_processes=1, initializer=init, initargs=(barrier, counter)) as pool:
        pool.resize(3)
        assert len(set(pool.map(meet, range(3), chunksize=1))) == 3
        assert pool._min == 1 and pool._processes == 3


@pytest.mark.parametrize("kwargs, message", [
    ({"min_processes": 5}, "min_processes must be an int from 0 to processes"),
    ({"min_processes": -1}, "min_processes must be an int from 0 to processes"),
    ({"min_processes": 1.5}, "min_processes must be an int"),
    ({"idle_timeout": 0}, "idle_timeout must be a number of seconds above 0"),
    ({"idle_timeout": "60"}, "idle_timeout must be a number"),
])
def test_bad_arguments_say_what_is_expected(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Pool(4, **kwargs)
