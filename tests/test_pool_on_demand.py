"""Flyte's rule: a task whose workers were preempted N times runs its next attempt on
on-demand capacity. The decisions here; a preempted pod on the Kubernetes emulator in
plugins/fiber_k8s/tests/test_k8s_on_demand.py, a lost spot host in plugins/fiber_ssh/tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import fiber_core
from fiber_core.base.errors import ConfigError
from fiber_core.parallel.pool.on_demand import (
    ON_DEMAND_AFTER,
    on_demand_after_of,
    on_demand_keywords,
    pool_capacity,
    runs_on_demand,
)
from fiber_core.runtime.config import config


@pytest.fixture
def settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Environment settings read afresh, and forgotten after the test."""
    monkeypatch.delenv("FIBER_ON_DEMAND_AFTER", raising=False)
    monkeypatch.delenv("FIBER_CAPACITY", raising=False)
    config.reset()
    yield monkeypatch
    monkeypatch.delenv("FIBER_ON_DEMAND_AFTER", raising=False)
    monkeypatch.delenv("FIBER_CAPACITY", raising=False)
    config.reset()


def test_a_unit_goes_on_demand_once_its_workers_were_preempted_the_pools_bound_times() -> None:
    assert [runs_on_demand(n, 2) for n in range(4)] == [False, False, True, True]
    assert [runs_on_demand(n, 1) for n in range(2)] == [False, True]
    assert not runs_on_demand(10, None)  # the rule is off: the pool is not on spot-then-on-demand


def test_the_bound_applies_to_spot_then_on_demand_only_and_defaults_to_two(settings: pytest.MonkeyPatch) -> None:
    assert on_demand_after_of(None, "spot-then-on-demand") == ON_DEMAND_AFTER == 2
    assert on_demand_after_of(3, "spot-then-on-demand") == 3
    for capacity in ("spot", "on-demand", None):
        assert on_demand_after_of(None, capacity) is None
    settings.setenv("FIBER_ON_DEMAND_AFTER", "4")
    config.reset()
    assert on_demand_after_of(None, "spot-then-on-demand") == 4
    assert on_demand_after_of(1, "spot-then-on-demand") == 1  # the Pool's own wins
    assert on_demand_after_of(None, "spot") is None  # the setting is for the pools it applies to


@pytest.mark.parametrize(("value", "capacity", "message"), [
    (0, "spot-then-on-demand", r"on_demand_after must be an int of 1 or more .* not 0"),
    (-1, "spot-then-on-demand", r"on_demand_after must be an int of 1 or more"),
    (1.5, "spot-then-on-demand", r"on_demand_after must be an int of 1 or more"),
    (True, "spot-then-on-demand", r"on_demand_after must be an int of 1 or more"),
    (2, "spot", r"on_demand_after=2 applies to capacity='spot-then-on-demand' only, and this pool asks "
                r"for capacity='spot': pass capacity='spot-then-on-demand', or leave on_demand_after out"),
    (2, None, r"this pool asks for capacity=None"),
])
def test_a_bad_bound_is_refused_saying_what_to_write(value: object, capacity: str | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        on_demand_after_of(value, capacity)


def test_a_setting_below_one_is_refused_naming_it(settings: pytest.MonkeyPatch) -> None:
    settings.setenv("FIBER_ON_DEMAND_AFTER", "0")
    config.reset()
    with pytest.raises(ConfigError, match=r"on_demand_after=0 \(the setting\): expected 1 or more"):
        on_demand_after_of(None, "spot-then-on-demand")


def test_a_pools_capacity_is_its_own_else_its_initializers_else_the_setting(settings: pytest.MonkeyPatch) -> None:
    @fiber_core.meta(capacity="spot")
    def init() -> None:
        pass

    assert pool_capacity({"capacity": "spot-then-on-demand"}, init) == "spot-then-on-demand"
    assert pool_capacity({}, init) == "spot"
    assert pool_capacity({}, None) is None
    settings.setenv("FIBER_CAPACITY", "spot-then-on-demand")
    config.reset()
    assert pool_capacity({}, None) == "spot-then-on-demand"


def test_the_on_demand_workers_are_the_pools_own_on_on_demand_capacity_elastic_from_none() -> None:
    keywords = {"processes": 8, "min_processes": 8, "capacity": "spot-then-on-demand", "gpu": 1, "task_losses": 5}
    assert on_demand_keywords(keywords) == {"processes": 8, "min_processes": 0, "capacity": "on-demand", "gpu": 1,
                                            "task_losses": 5, "on_demand_after": None}


def test_a_pool_refuses_a_bound_it_cannot_use_before_any_worker_starts(settings: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="applies to capacity='spot-then-on-demand' only"):
        fiber_core.Pool(2, on_demand_after=2)
    with pytest.raises(ValueError, match="on_demand_after must be an int of 1 or more"):
        fiber_core.Pool(2, capacity="spot-then-on-demand", on_demand_after=0)
    with pytest.raises(ValueError, match="applies to capacity='spot-then-on-demand' only"):
        fiber_core.Pool(1, roles={"learner": {"processes": 1, "capacity": "spot", "on_demand_after": 1}})


def test_a_spot_then_on_demand_pool_that_is_never_preempted_makes_no_on_demand_workers(
        settings: pytest.MonkeyPatch) -> None:
    # (the local backend has one kind of capacity: the request is accepted and changes nothing)
    with fiber_core.Pool(2, capacity="spot-then-on-demand", on_demand_after=1) as pool:
        assert pool.map(abs, range(-20, 0)) == list(range(20, 0, -1))
        assert pool._on_demand is None
