"""A Pool's cost cap: ``max_hourly_cost`` by the ``prices`` setting, on the local backend (a worker
there costs the ``cpu`` price); the pure decisions in ``fiber_core.contract.placement``."""

from __future__ import annotations

import logging

import pytest
from procs import wait_until

import fiber_core
from fiber_core.base.errors import ConfigError
from fiber_core.contract import (
    Alternative,
    GpuChoice,
    alternative_cost,
    capped_workers,
    parse_prices,
    worker_cost,
)

PRICES = parse_prices(["a100:4", "a100@spot:1.5", "L4:0.75", "cpu:0.5"])


def test_prices_per_gpu_type_kind_and_cpu() -> None:
    assert PRICES == {("a100", None): 4.0, ("a100", "spot"): 1.5, ("l4", None): 0.75, ("cpu", None): 0.5}
    assert alternative_cost(Alternative(GpuChoice("a100", 2), "spot"), PRICES) == 3.0
    assert alternative_cost(Alternative(GpuChoice("A100", 1), "on-demand"), PRICES) == 4.0  # any kind
    assert alternative_cost(Alternative(GpuChoice("l4", 2)), PRICES) == 1.5
    assert alternative_cost(Alternative(), PRICES) == 0.5
    assert alternative_cost(Alternative(GpuChoice("h100", 1)), PRICES) is None
    for bad in ("a100", "a100:x", "a100@cheap:1", ":1", "a100:-1"):
        with pytest.raises(ConfigError, match="expected TYPE"):
            parse_prices([bad])


def test_a_worker_costs_its_dearest_alternative_and_the_cap_counts_whole_workers() -> None:
    choices = (Alternative(GpuChoice("a100", 1), "spot"), Alternative(GpuChoice("l4", 2), "spot"),
               Alternative(GpuChoice("a100", 1), "on-demand"))
    assert worker_cost(choices, PRICES) == (4.0, choices[2])
    with pytest.raises(ConfigError, match=r"needs the price of h100:1 .* add h100:PRICE \(per GPU and hour\)"):
        worker_cost((Alternative(GpuChoice("h100", 1)),), PRICES)
    assert capped_workers(8, None, 4.0) == 8
    assert capped_workers(8, 10.0, 4.0) == 2
    assert capped_workers(8, 12.0, 4.0) == 3  # exactly at the cap fits
    assert capped_workers(8, 10.0, 0.0) == 8


def _workers(pool: fiber_core.Pool) -> int:
    return len(pool._pool)


def test_a_capped_pool_runs_fewer_workers_says_why_once_and_grows_when_the_cap_rises(
        caplog: pytest.LogCaptureFixture) -> None:
    fiber_core.init(prices="cpu:1.5")
    with caplog.at_level(logging.WARNING, logger="fiber"):
        with fiber_core.Pool(4, max_hourly_cost=3.5) as pool:
            assert pool._processes == 2
            wait_until(lambda: _workers(pool) == 2, "two workers")
            assert pool.map(abs, range(-10, 0)) == list(range(10, 0, -1))
            said = [r.getMessage() for r in caplog.records if "max_hourly_cost" in r.getMessage()]
            assert said == ["fiber: the pool runs 2 of its 4 workers: each may cost 1.50/h (any), and "
                            "max_hourly_cost=3.5 allows 3.00/h for 2; raise the cap "
                            "(Pool.set_max_hourly_cost) to grow it"]
            pool.resize(4)  # the same cap, asked again: said once already for this size
            assert len([r for r in caplog.records if "max_hourly_cost" in r.getMessage()]) == 1
            pool.set_max_hourly_cost(6.0)
            assert pool._processes == 4
            wait_until(lambda: _workers(pool) == 4, "four workers")
            pool.set_max_hourly_cost(None)
            assert pool._processes == 4


def test_a_cap_below_one_worker_or_without_a_price_is_an_error_at_once() -> None:
    fiber_core.init(prices="cpu:1.5")
    with pytest.raises(ConfigError, match=r"max_hourly_cost=1 is below what one worker may cost: 1.50/h"):
        fiber_core.Pool(2, max_hourly_cost=1.0)
    fiber_core.init(prices="a100:4")
    with pytest.raises(ConfigError, match=r"needs the price of any in the prices setting: add cpu:PRICE"):
        fiber_core.Pool(2, max_hourly_cost=10.0)


def test_the_setting_caps_every_pool_that_names_none() -> None:
    fiber_core.init(prices="cpu:2", max_hourly_cost=2.0)
    with fiber_core.Pool(3) as pool:
        assert pool._processes == 1
        assert pool.apply(abs, (-1,)) == 1
