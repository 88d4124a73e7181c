"""Flyte's rule for a Pool on spot capacity: a unit whose workers were preempted N times runs
its next attempt on on-demand capacity.

A Pool with ``capacity="spot-then-on-demand"`` counts, for each unit, the preemptions of the
workers that ran it (``EndReason.PREEMPTED``: the platform took the machine back). A unit that
reaches ``on_demand_after`` (:data:`ON_DEMAND_AFTER` by default) leaves the pool's queue for
its *on-demand workers*: a Pool of their own inside (as a role is, see
:mod:`~fiber_core.parallel.pool.roles`), made the first time a unit needs them, asking for
``capacity="on-demand"``, elastic from none up to the pool's size, with loss budgets of their
own; once idle for the pool's ``idle_timeout`` they go.

Which units count: those of the batch the worker ran when it was lost (its oldest). The pool
holds them until the worker's end says why it ended (a preemption, or anything else), then
sends them on: back to its own queue, or to the on-demand workers.

The decisions are the pure functions at the top; :class:`OnDemandFallback` applies them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fiber_core.base.errors import ConfigError
from fiber_core.base.log import log
from fiber_core.contract.jobs import EndReason
from fiber_core.parallel.pool.master import Master
from fiber_core.parallel.pool.table import Unit, Worker
from fiber_core.runtime.config import config

SPOT_THEN_ON_DEMAND = "spot-then-on-demand"
"""The one capacity kind the rule applies to: the others name one kind, which no attempt leaves."""

ON_DEMAND_AFTER = 2
"""Preemptions of a unit's workers before its next attempt runs on on-demand capacity: one is
the ordinary bad luck of spot capacity; a second says that the unit runs long enough on spot
to be hit again, so that a third attempt there may well be lost too."""


def pool_capacity(resources: Mapping[str, Any], initializer: Any) -> str | None:
    """The capacity kind a pool's workers ask for: the Pool's keyword, else its initializer's
    ``meta``, else the ``capacity`` setting (as their jobs resolve it)."""
    meta = getattr(initializer, "__fiber_meta__", None) or {}
    for asked in (resources.get("capacity"), meta.get("capacity")):
        if asked is not None:
            return asked
    return config.get("capacity")


def on_demand_after_of(value: Any, capacity: str | None) -> int | None:
    """The rule's bound for a pool whose workers ask for ``capacity``: ``value`` (the Pool's
    ``on_demand_after``), else the ``on_demand_after`` setting, else :data:`ON_DEMAND_AFTER`;
    ``None`` where the rule does not apply (any capacity but ``spot-then-on-demand``).

    A bound below 1, or one given to a pool of another capacity, is refused with what to write.
    """
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"on_demand_after must be an int of 1 or more (the preemptions of a task's "
                             f"workers before its next attempt runs on on-demand capacity), not {value!r}")
        if capacity != SPOT_THEN_ON_DEMAND:
            raise ValueError(f"on_demand_after={value} applies to capacity='{SPOT_THEN_ON_DEMAND}' only, and "
                             f"this pool asks for capacity={capacity!r}: pass capacity='{SPOT_THEN_ON_DEMAND}', "
                             "or leave on_demand_after out")
        return value
    if capacity != SPOT_THEN_ON_DEMAND:
        return None
    setting = config.get("on_demand_after")
    if setting is None:
        return ON_DEMAND_AFTER
    if setting < 1:
        raise ConfigError(f"on_demand_after={setting} (the setting): expected 1 or more, the preemptions of a "
                          "task's workers before its next attempt runs on on-demand capacity")
    return int(setting)


def runs_on_demand(preemptions: int, after: int | None) -> bool:
    """Whether a unit whose workers were preempted ``preemptions`` times runs its next attempt on
    on-demand capacity, in a pool whose bound is ``after`` (``None``: the rule is off)."""
    return after is not None and preemptions >= after


def on_demand_keywords(keywords: Mapping[str, Any]) -> dict[str, Any]:
    """The Pool keywords of a pool's on-demand workers, from the pool's own: the same size (at
    most), resources and budgets, on on-demand capacity, elastic from none."""
    return {**keywords, "capacity": "on-demand", "min_processes": 0, "on_demand_after": None}


class OnDemandFallback(Master):
    """The rule applied: the units a preempted worker ran, counted, and the on-demand workers."""

    _on_demand: OnDemandFallback | None = None  # the Pool of on-demand workers, made when first needed
    _due: tuple[Unit, ...] = ()  # units the rule sends on once the master lets go of the lock

    def _new_on_demand_pool(self) -> OnDemandFallback:
        """A Pool of this pool's on-demand workers (the facade makes it)."""
        raise NotImplementedError

    def terminate(self) -> None:
        """Stop every worker now (the facade's ``Pool.terminate``)."""
        raise NotImplementedError

    def _place_ran(self, w: Worker, reason: EndReason | None,
                   culprit: tuple[Unit, int] | None) -> tuple[Unit, int] | None:
        """Where the units of the batch a lost worker ran go, now that its end is known (lock
        held). Preempted: each counts one more preemption, and those at the bound go to the
        on-demand workers; the others run again here. Returns ``culprit`` where it stays here
        (the ledger charges it), else None."""
        held, w.ran = w.ran, []
        if reason is not EndReason.PREEMPTED:
            self._requeue(held)
            return culprit
        due = []
        for unit in held + ([culprit[0]] if culprit is not None else []):
            unit.preemptions += 1
            if runs_on_demand(unit.preemptions, self._on_demand_after) and unit.call_id in self._calls:
                due.append(unit)
        self._requeue([u for u in held if u not in due])
        self._due += tuple(due)
        return None if culprit is not None and culprit[0] in due else culprit

    def _on_exit(self, w: Worker) -> None:
        super()._on_exit(w)
        if self._due:
            due, self._due = list(self._due), ()
            self._to_on_demand(due)

    def _to_on_demand(self, units: list[Unit]) -> None:
        """Hand ``units`` to the on-demand workers, made now if there are none yet (in the master
        thread, without this pool's lock: the on-demand pool's is never taken under it)."""
        units = [u for u in units if u.call_id in self._calls]
        for unit in units:
            log.info("fiber: the workers of %s were preempted %d times (on_demand_after=%d): its next "
                     "attempt runs on on-demand capacity", unit.name(), unit.preemptions, self._on_demand_after)
        try:
            pool = self._on_demand
            if pool is None:
                pool = self._new_on_demand_pool()
                with self._lock:  # (terminate() reads it once this pool is TERMINATE)
                    ended = self._state == "TERMINATE"
                    if not ended:
                        self._on_demand = pool
                if ended:
                    pool.terminate()
                    return
            pool._take_units(units)  # noqa: SLF001 - a pool of this class, its own part
        except Exception as e:  # the on-demand workers cannot start: the units run again here
            log.warning("fiber: no on-demand workers (%s): %d task(s) run again on spot capacity", e, len(units))
            self._requeue(units)

    def _take_units(self, units: list[Unit]) -> None:
        """Run ``units`` of another pool's calls (this is that pool's on-demand workers)."""
        with self._lock:
            if self._state == "TERMINATE" or self._done.is_set():
                raise ValueError("the on-demand workers were stopped")
            for unit in units:
                self._calls.setdefault(unit.call_id, unit.call)
            self._requeue(units)
        self._wake()

    def end_call(self, call: Any) -> None:
        super().end_call(call)
        if self._on_demand is not None:
            self._on_demand.end_call(call)

    def _drop_call(self, call: Any) -> None:
        super()._drop_call(call)
        if self._on_demand is not None:
            self._on_demand.cancel_call(call)
