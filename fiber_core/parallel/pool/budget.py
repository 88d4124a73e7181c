"""A Pool's cost cap: how many of its workers fit under ``max_hourly_cost`` by the ``prices``
setting, and saying so once when it runs fewer than asked."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fiber_core.base.errors import ConfigError
from fiber_core.base.log import log
from fiber_core.contract.placement import (
    Alternative,
    alternatives,
    capped_workers,
    gpu_choices,
    parse_prices,
    worker_cost,
)
from fiber_core.runtime.config import config


class CostCap:
    """The cap of one Pool: the size asked for, the cap, what one worker may cost.

    A worker costs the dearest of the places it may run (its GPU alternatives on its
    capacity kinds), so that workers placed anywhere stay under the cap together.
    """

    def __init__(self, wanted: int, cap: float | None, initializer: Callable | None,
                 resources: Mapping[str, Any]) -> None:
        self.wanted = wanted
        self.cap: float | None = None
        self.cost = 0.0
        self.dearest = Alternative()
        self._said: tuple[float | None, int] | None = None
        wanted_keys = ("gpu", "gpu_type", "capacity")
        asked = {k: config.get(k) for k in wanted_keys}
        meta = getattr(initializer, "__fiber_meta__", None) or {}
        asked.update({k: meta[k] for k in wanted_keys if meta.get(k) is not None})
        asked.update({k: resources[k] for k in wanted_keys if resources.get(k) is not None})
        self._choices = alternatives(gpu_choices(asked["gpu_type"], asked["gpu"]), asked["capacity"]) or (Alternative(),)
        self.change(cap if cap is not None else config.get("max_hourly_cost"))

    def change(self, cap: float | None) -> int:
        """Take ``cap`` (``None``: none); the number of workers the pool may run now. A cap
        below what one worker may cost is a ConfigError: such a pool could run nothing."""
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap < 0:
                raise ConfigError(f"max_hourly_cost={cap!r}: expected a number of at least 0 (per hour)")
            self.cost, self.dearest = worker_cost(self._choices, parse_prices(config.get("prices") or []))
            if capped_workers(1, cap, self.cost) < 1:
                raise ConfigError(f"max_hourly_cost={cap:g} is below what one worker may cost: {self.cost:.2f}/h "
                                  f"({self.dearest}, the dearest of its alternatives). Raise the cap, or drop "
                                  "the dearer alternatives")
        self.cap = cap
        return self.fit(self.wanted)

    def fit(self, wanted: int) -> int:
        """Record a size asked for (``Pool(n)``, ``resize(n)``); the size the cap allows, said once."""
        self.wanted = wanted
        allowed = capped_workers(wanted, self.cap, self.cost)
        if allowed < wanted and self._said != (self.cap, wanted):
            self._said = (self.cap, wanted)
            log.warning("fiber: the pool runs %d of its %d workers: each may cost %.2f/h (%s), and "
                        "max_hourly_cost=%g allows %.2f/h for %d; raise the cap (Pool.set_max_hourly_cost) "
                        "to grow it", allowed, wanted, self.cost, self.dearest, self.cap,
                        allowed * self.cost, allowed)
        return allowed

    @property
    def hourly_cost(self) -> float | None:
        """What the workers allowed cost per hour at most, when the pool has a cap."""
        return None if self.cap is None else capped_workers(self.wanted, self.cap, self.cost) * self.cost
