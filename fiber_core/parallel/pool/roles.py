"""Roles: named sets of a Pool's workers with sizes and resources of their own (pure).

``Pool(64, roles={"learner": {"processes": 1, "gpu": 1}})`` is one pool of 64 default
workers and one worker of the role ``learner``. A call goes to a role when it names one
(``pool.apply(train, args, role="learner")``), or when its function asks, through
:func:`fiber_core.meta`, for resources that the default workers lack and a role has
(``@meta(gpu=1)`` goes to the first role with a GPU); anything else runs on the default
workers. Each role is a Pool of its own inside (its own size, elastic minimum, loss
budgets and backend), so what holds for a Pool holds for each role.

This module only decides: what a role may say, and which role a call goes to.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

DEFAULT = ""  # the pool's own workers, in the routing table

# What a role's spec may say: the Pool's own keywords and the resources of its workers.
ROLE_KEYWORDS = frozenset({
    "processes", "min_processes", "idle_timeout", "initializer", "initargs", "maxtasksperchild",
    "backend", "retries", "task_losses", "loss_limit", "backup", "max_hourly_cost",
    "cpu", "memory", "gpu", "gpu_type", "capacity", "image", "on_demand_after",
})
_NAME = re.compile(r"[a-z][a-z0-9_-]{0,39}\Z")
_NUMERIC = ("cpu", "memory", "gpu")


def parse_roles(roles: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Each role's Pool keywords, checked: ``{"name": 4}`` is ``{"name": {"processes": 4}}``.

    Raises ``ValueError``/``TypeError`` with what to write instead, before any worker starts.
    """
    if roles is None:
        return {}
    if not isinstance(roles, Mapping):
        raise TypeError(f"roles must be a dict of role name to a size or to Pool keywords, "
                        f"such as {{'learner': {{'processes': 1, 'gpu': 1}}}}; not {roles!r}")
    out: dict[str, dict[str, Any]] = {}
    for name, spec in roles.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"role name {name!r}: use lowercase letters, digits, '-' and '_', "
                             "starting with a letter (at most 40)")
        if isinstance(spec, int) and not isinstance(spec, bool):
            spec = {"processes": spec}
        if not isinstance(spec, Mapping):
            raise TypeError(f"role {name!r}: a size (an int) or a dict of Pool keywords, "
                            f"such as {{'processes': 1, 'gpu': 1}}; not {spec!r}")
        unknown = sorted(set(spec) - ROLE_KEYWORDS)
        if unknown:
            raise TypeError(f"role {name!r}: unknown keyword(s) {', '.join(unknown)}; a role takes "
                            f"{', '.join(sorted(ROLE_KEYWORDS))}")
        if "processes" not in spec:
            raise ValueError(f"role {name!r}: say how many workers it has: {{'processes': N, ...}}")
        out[name] = dict(spec)
    return out


def _has(offered: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """Whether workers with resources ``offered`` can run a function that asks for ``wanted``."""
    for key in _NUMERIC:
        need = wanted.get(key)
        if need and (offered.get(key) or 0) < need:
            return False
    need_type = wanted.get("gpu_type")
    return not need_type or offered.get("gpu_type") == need_type


def route(role: str | None, wanted: Mapping[str, Any] | None,
          offered: Mapping[str, Mapping[str, Any]]) -> str:
    """The role a call goes to: :data:`DEFAULT` or a role's name.

    ``role``: what the call named, if anything; ``wanted``: the function's ``meta``
    resources; ``offered``: the resources of each role's workers, the default workers'
    under :data:`DEFAULT` first (the routing table, in the order the roles were given).
    """
    if role is not None:
        if role == DEFAULT or role not in offered:
            known = ", ".join(repr(n) for n in offered if n != DEFAULT) or "none"
            raise ValueError(f"no role {role!r} in this pool (its roles: {known})")
        return role
    wanted = {k: v for k, v in (wanted or {}).items() if v}
    if not wanted or len(offered) == 1:
        return DEFAULT  # a pool without roles runs everything, as it always has
    for name, resources in offered.items():
        if _has(resources, wanted):
            return name
    asked = ", ".join(f"{k}={v!r}" for k, v in sorted(wanted.items()))
    raise ValueError(f"no worker of this pool has what the function asks for ({asked}): add a "
                     f"role that has it, e.g. Pool(..., roles={{'big': {{'processes': 1, {asked}}}}}), "
                     "or name a role with role=...")
