"""Group starts: several processes started with one call to their backend, all or nothing."""

from __future__ import annotations

import threading

import pytest

import fiber_core
from fiber_core.base.errors import BackendError
from fiber_core.contract.backend import Job, JobSpec
from fiber_core.processes.process import start_processes
from fiber_core.runtime.run import runtime

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed


def put_square(q: fiber_core.Queue, x: int) -> None:
    q.put(x * x)


def test_started_together_they_run_as_if_started_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = runtime().backend
    calls: list[int] = []
    real = type(backend).start_jobs

    def counted(self: object, specs: list[JobSpec]) -> list[Job]:
        calls.append(len(specs))
        return real(backend, specs)

    monkeypatch.setattr(backend, "start_jobs", counted.__get__(backend))
    q = fiber_core.Queue()
    ps = [fiber_core.Process(target=put_square, args=(q, i)) for i in range(4)]
    start_processes(ps)
    assert calls == [4]  # one call for the four jobs
    assert sorted(q.get(timeout=T) for _ in ps) == [0, 1, 4, 9]
    for p in ps:
        p.join(T)
        assert p.exitcode == 0
    assert not any(p in fiber_core.active_children() for p in ps)
    with pytest.raises(AssertionError, match="cannot start a process twice"):
        start_processes(ps[:1])


def test_nothing_starts_when_one_cannot_be_sent() -> None:
    q = fiber_core.Queue()
    good = fiber_core.Process(target=put_square, args=(q, 2))
    bad = fiber_core.Process(target=put_square, args=(threading.Lock(), 3))  # a lock cannot be pickled
    with pytest.raises(TypeError, match="lock"):
        start_processes([good, bad])
    assert good.pid is None and not good.is_alive() and bad.pid is None
    good.start()  # the untouched one can still start on its own
    assert q.get(timeout=T) == 4
    good.join(T)


def test_nothing_starts_when_the_backend_refuses() -> None:
    fiber_core.init(python="/nonexistent/python")
    q = fiber_core.Queue()
    ps = [fiber_core.Process(target=put_square, args=(q, i)) for i in range(3)]
    with pytest.raises(BackendError, match="/nonexistent/python"):
        start_processes(ps)
    assert all(p.pid is None and not p.is_alive() for p in ps)
    assert not fiber_core.active_children()


def test_a_process_given_twice_is_refused() -> None:
    p = fiber_core.Process(target=put_square, args=(None, 1))
    with pytest.raises(ValueError, match="given twice"):
        start_processes([p, p])
