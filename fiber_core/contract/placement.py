"""Where a job may run: the GPU alternatives of a request, in order of preference, and the
record of what a job got (``current_process().resources``).

A request names its GPU types in one of these forms (``gpu_type`` of ``meta``, ``Process``,
``Pool`` and the ``gpu_type`` setting)::

    "a100"                          one type; ``gpu`` GPUs of it (one when ``gpu`` is unset)
    ["a100", "l40s"]                the first that a backend can place, each with ``gpu`` GPUs
    [("a100", 1), ("l4", 2)]        an A100, else two L4s
    "a100, l4:2"                    the same as a string (settings, environment variables)

:func:`gpu_choices` turns any of them into a tuple of :class:`GpuChoice`, once, in the core
(:class:`~fiber_core.contract.JobSpec` holds it as ``gpu_choices``); bad input is a
:class:`~fiber_core.base.errors.ConfigError` at once. A backend that tries alternatives in
order sets :attr:`~fiber_core.contract.Backend.gpu_alternatives`; any other is refused a
request of several, with an error, rather than silently given the first.

A backend tells the job what it got through the job's environment (:data:`ENV_RESOURCES`,
built by :func:`resources_env`); :func:`job_resources` reads it back in the job.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fiber_core.base.errors import ConfigError
from fiber_core.base.options import Option
from fiber_core.contract.env import ENV_JOB_HOST

__all__ = ["CAPACITIES", "ENV_NODE", "ENV_RESOURCES", "FALLBACK_WAIT", "RESOURCE_KEYS", "Alternative", "GpuChoice",
           "alternatives", "alternative_cost", "capacity_kinds", "capped_workers", "choice_text", "gpu_choices",
           "job_resources", "parse_prices", "resources_env", "waiting_verdict", "worker_cost"]

CAPACITIES = {"spot": ("spot",), "on-demand": ("on-demand",), "spot-then-on-demand": ("spot", "on-demand")}
"""The ``capacity`` a job may ask for, and the kinds each tries in order: spot, on-demand, or
spot first and on-demand when no spot capacity comes within the backend's ``fallback_wait``."""

FALLBACK_WAIT = Option("fallback_wait", float, 60.0,
                       "seconds a job waits for capacity of one GPU alternative before it tries the next "
                       "(the last waits as long as a job of one type would)")
"""The ``fallback_wait`` setting of a backend that tries GPU alternatives one after another."""

ENV_RESOURCES = "FIBER_RESOURCES"
"""What a job got, as JSON: the keys of :data:`RESOURCE_KEYS` a backend knows when it creates
the job (the GPU type and count of the alternative it chose, the capacity kind, the cost)."""

ENV_NODE = "FIBER_NODE"
"""The machine a job runs on, where its backend learns it only once the job is placed (on
Kubernetes, the node from the downward API): the ``host`` of :func:`job_resources`."""

RESOURCE_KEYS = ("gpu_type", "gpu", "capacity", "host", "cost_per_hour")
"""The keys of ``current_process().resources``, the same on every backend: the GPU type and
count the job got (``None`` and 0 without GPUs), the capacity kind (``"spot"``,
``"on-demand"``, ``None`` when unknown), the machine it runs on, its cost per hour when the
settings price what it got (else ``None``)."""


@dataclass(frozen=True)
class GpuChoice:
    """One alternative of a request: ``count`` GPUs of ``type`` (``-1``: every GPU of a node)."""

    type: str
    count: int = 1

    def __str__(self) -> str:
        return f"{self.type}:{self.count}"


@dataclass(frozen=True)
class Alternative:
    """One place a job may run: a GPU alternative (``None``: no GPU type) on a capacity kind
    (``"spot"``, ``"on-demand"``, ``None``: whatever the platform gives)."""

    gpu: GpuChoice | None = None
    capacity: str | None = None

    def __str__(self) -> str:
        parts = [str(self.gpu)] if self.gpu is not None else []
        return " ".join(parts + ([self.capacity] if self.capacity else [])) or "any"


def choice_text(choices: Sequence[GpuChoice | Alternative]) -> str:
    """``choices`` as a user writes them: ``a100:1, l4:2``."""
    return ", ".join(map(str, choices))


def capacity_kinds(capacity: str | None) -> tuple[str, ...]:
    """The capacity kinds a ``capacity`` request tries, in order (:data:`CAPACITIES`); ``()``
    for ``None``. Anything else is a :class:`~fiber_core.base.errors.ConfigError`."""
    if capacity is None:
        return ()
    kinds = CAPACITIES.get(capacity) if isinstance(capacity, str) else None
    if kinds is None:
        raise ConfigError(f"capacity={capacity!r}: expected one of {', '.join(map(repr, CAPACITIES))}")
    return kinds


def alternatives(choices: Sequence[GpuChoice], capacity: str | None) -> tuple[Alternative, ...]:
    """Every place a job may run, in the order a backend tries them: each capacity kind in
    turn (spot before on-demand: the cheaper kind of every GPU type first), and in each the
    GPU alternatives in order. ``()`` when the job names neither."""
    if not choices and capacity is None:
        return ()
    gpus: Sequence[GpuChoice | None] = choices or (None,)
    kinds: Sequence[str | None] = capacity_kinds(capacity) or (None,)
    return tuple(Alternative(g, k) for k in kinds for g in gpus)


def _entries(gpu_type: Any) -> list[Any]:
    """The alternatives of ``gpu_type`` before they are checked, one entry each."""
    if isinstance(gpu_type, str):
        parts = [p.strip() for p in gpu_type.split(",")]
        if len(parts) > 1 and not all(parts):
            raise ConfigError(f"gpu_type={gpu_type!r}: an empty entry between commas; write 'a100, l4:2'")
        return [_split_count(p, gpu_type) for p in parts]
    if isinstance(gpu_type, tuple) and len(gpu_type) == 2 and isinstance(gpu_type[1], int) \
            and isinstance(gpu_type[0], str):
        return [gpu_type]  # ("a100", 2): one alternative with its count
    if isinstance(gpu_type, (list, tuple)):
        return list(gpu_type)
    raise ConfigError(f"gpu_type={gpu_type!r}: expected a GPU type (a string), or a list of them in order "
                      "of preference, each a string or a (type, count) pair: ['a100', ('l4', 2)]")


def _split_count(text: str, whole: str) -> Any:
    """``"l4:2"`` as ``("l4", 2)``; ``"a100"`` as it is."""
    name, sep, count = text.rpartition(":")
    if not sep:
        return text
    if not count.strip().lstrip("-").isdigit():
        raise ConfigError(f"gpu_type={whole!r}: {text!r} is not TYPE or TYPE:COUNT (a whole number of GPUs)")
    return (name.strip(), int(count))


def gpu_choices(gpu_type: Any, gpu: int | None = None) -> tuple[GpuChoice, ...]:
    """The GPU alternatives of a request, in order of preference; ``()`` for ``None``.

    ``gpu_type`` is a string (``"a100"``, or ``"a100, l4:2"``), a list of strings and
    ``(type, count)`` pairs, or one such pair. An entry without a count takes ``gpu`` (one
    when ``gpu`` is ``None`` or 0; ``-1``, every GPU of a node, stays ``-1``). Raises
    :class:`~fiber_core.base.errors.ConfigError` for an empty list, an entry that is not a
    string or a pair, an empty name, a count below 1, or a type named twice (the case of a
    name does not count: backends match types case-insensitively).
    """
    if gpu_type is None:
        return ()
    entries = _entries(gpu_type)
    if not entries:
        raise ConfigError("gpu_type=[]: an empty list of GPU types; give at least one, e.g. ['a100', 'l40s'], "
                          "or leave gpu_type unset")
    default = gpu if gpu else 1
    out: list[GpuChoice] = []
    seen: dict[str, str] = {}
    for entry in entries:
        name, count = _entry(entry, gpu_type, default)
        key = name.lower()
        if key in seen:
            raise ConfigError(f"gpu_type={gpu_type!r}: {name!r} is listed twice (as {seen[key]!r} before); "
                              "name each GPU type once")
        seen[key] = name
        out.append(GpuChoice(name, count))
    return tuple(out)


def _entry(entry: Any, whole: Any, default: int) -> tuple[str, int]:
    """One checked alternative: (name, count)."""
    if isinstance(entry, (tuple, list)) and len(entry) == 2:
        name, count = entry
        if isinstance(count, bool) or not isinstance(count, int):
            raise ConfigError(f"gpu_type={whole!r}: the count of {name!r} is {count!r}; give a whole number "
                              "of GPUs, at least 1")
        if count < 1:
            raise ConfigError(f"gpu_type={whole!r}: {count} GPU(s) of {name!r}; a count is at least 1")
    else:
        name, count = entry, default
    if not isinstance(name, str):
        raise ConfigError(f"gpu_type={whole!r}: {name!r} is not a GPU type; each alternative is a string "
                          "or a (type, count) pair, e.g. ['a100', ('l4', 2)]")
    if not name.strip():
        raise ConfigError(f"gpu_type={whole!r}: an empty GPU type name")
    return name.strip(), count


def resources_env(choice: GpuChoice | None, *, gpu: int = 0, capacity: str | None = None, host: str | None = None,
                  cost_per_hour: float | None = None) -> dict[str, str]:
    """The job's environment entry that says what it got: ``{ENV_RESOURCES: json}``.

    ``choice``: the GPU alternative it got, else ``gpu`` GPUs of no named type. A backend
    that places the job sets it when it creates the job; ``host`` only where it knows the
    machine then (else :data:`ENV_NODE`, or the job's own host name, says it).
    """
    record: dict[str, Any] = {
        "gpu_type": choice.type if choice is not None else None,
        "gpu": choice.count if choice is not None else gpu,
        "capacity": capacity,
        "cost_per_hour": cost_per_hour,
    }
    if host is not None:
        record["host"] = host
    return {ENV_RESOURCES: json.dumps(record, sort_keys=True, separators=(",", ":"))}


def job_resources(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What this job got (``current_process().resources``): every key of :data:`RESOURCE_KEYS`.

    Read from :data:`ENV_RESOURCES`; the host from it, else :data:`ENV_NODE`, else
    ``FIBER_JOB_HOST``, else this machine's name. Without a record (the program's own
    process, a backend that sets none): no GPU, capacity and cost unknown.
    """
    env = os.environ if environ is None else environ
    record: dict[str, Any] = {}
    text = env.get(ENV_RESOURCES)
    if text:
        try:
            loaded = json.loads(text)
        except ValueError:
            loaded = None
        if isinstance(loaded, dict):
            record = loaded
    out = {k: record.get(k) for k in RESOURCE_KEYS}
    out["gpu"] = out["gpu"] or 0
    out["host"] = out["host"] or env.get(ENV_NODE) or env.get(ENV_JOB_HOST) or socket.gethostname()
    return out


def waiting_verdict(choice: int, choices: int, waited: float, fallback_wait: float, timeout: float) -> str:
    """What to do with a job still waiting for capacity on alternative ``choice`` (0-based) of
    ``choices``, after ``waited`` seconds on it: ``"next"`` (try the next alternative) once it
    waited ``fallback_wait``, unless it is the last; the last ``"fail"`` s after ``timeout``
    (0: never), as a job of one type does; else ``"wait"``."""
    if choice + 1 < choices:
        return "next" if waited > fallback_wait else "wait"
    return "fail" if timeout > 0 and waited > timeout else "wait"


def parse_prices(entries: Sequence[str]) -> dict[tuple[str, str | None], float]:
    """The ``prices`` setting: ``TYPE[@KIND]:PRICE`` entries, the price per hour of one GPU of
    ``TYPE`` (on capacity ``KIND``, ``spot`` or ``on-demand``; without it, on any), and
    ``cpu[@KIND]:PRICE`` for a job without a GPU type. Keys ``(type lowercased, kind)``. A
    malformed entry is a :class:`~fiber_core.base.errors.ConfigError` that shows the form."""
    out: dict[tuple[str, str | None], float] = {}
    for entry in entries:
        what, sep, price = entry.rpartition(":")
        name, at, kind = what.partition("@")
        try:
            value = float(price)
        except ValueError:
            value = -1.0
        if not sep or not name.strip() or value < 0 or (at and kind.strip() not in ("spot", "on-demand")):
            raise ConfigError(f"bad prices entry {entry!r}: expected TYPE[@spot|@on-demand]:PRICE per GPU and hour, "
                              "or cpu[@KIND]:PRICE per job without GPU type, e.g. prices = a100:4.1, a100@spot:1.6, "
                              "cpu:0.05")
        out[(name.strip().lower(), kind.strip() or None)] = value
    return out


def alternative_cost(alternative: Alternative, prices: Mapping[tuple[str, str | None], float]) -> float | None:
    """What one job on ``alternative`` costs per hour by ``prices`` (:func:`parse_prices`): the
    price of its GPU type on its kind (else on any kind) times its count, or the ``cpu`` price
    of a job without GPU type; ``None`` when the table has no price for it."""
    name = alternative.gpu.type.lower() if alternative.gpu is not None else "cpu"
    price = prices.get((name, alternative.capacity), prices.get((name, None)))
    if price is None:
        return None
    return price * (max(alternative.gpu.count, 1) if alternative.gpu is not None else 1)


def worker_cost(choices: Sequence[Alternative], prices: Mapping[tuple[str, str | None], float]) -> tuple[float, Alternative]:
    """What one worker may cost per hour, whichever of its ``choices`` (``JobSpec.alternatives``;
    ``(Alternative(),)`` for a job that names none) it gets: the dearest, and which it is. A
    choice without a price is a :class:`~fiber_core.base.errors.ConfigError` saying what to add."""
    costs = []
    for alt in choices:
        cost = alternative_cost(alt, prices)
        if cost is None:
            name = alt.gpu.type.lower() if alt.gpu is not None else "cpu"
            kind = f"@{alt.capacity}" if alt.capacity else ""
            raise ConfigError(f"max_hourly_cost needs the price of {alt} in the prices setting: add "
                              f"{name}{kind}:PRICE (per {'GPU and ' if alt.gpu is not None else 'job and '}hour)")
        costs.append((cost, alt))
    return max(costs, key=lambda c: c[0])


def capped_workers(wanted: int, cap: float | None, cost: float) -> int:
    """How many of ``wanted`` workers of ``cost`` per hour each fit under ``cap`` per hour
    (all when there is no cap, or they cost nothing)."""
    if cap is None or cost <= 0:
        return wanted
    return min(wanted, int(cap // cost + 1e-9))
