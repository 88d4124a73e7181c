"""Layer 2, contract: what a backend is and the hooks a plugin implements.

Everything a backend plugin needs from Fiber is importable from here::

    from fiber_core.contract import Backend, EndReason, Job, JobSpec, Option, hookimpl
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # typing's own, without importing typing: a job starts without it
if TYPE_CHECKING:  # the names as type checkers see them; at run time each loads on first use
    from typing import Any

    from fiber_core.base.errors import BackendError, ConfigError, FiberError
    from fiber_core.base.install import install_elsewhere
    from fiber_core.base.net import keepalive
    from fiber_core.base.options import Option, parse_pairs
    from fiber_core.contract.backend import (
        ENV_OPTIONS,
        EXTRA_ENV,
        TIMEOUT_ALIAS,
        Backend,
        Job,
        JobSpec,
        gpu_count,
    )
    from fiber_core.contract.env import (
        ENV_AUTHKEY,
        ENV_GROUP,
        ENV_GROUP_INDEX,
        ENV_HUB,
        ENV_JOB_HOST,
        ENV_PARENT_PID,
        ENV_RUN_ID,
        ENV_TOKEN,
        PER_MEMBER_VARIABLES,
        SECRET_VARIABLES,
    )
    from fiber_core.contract.helpers import (
        clean_name,
        exitcode_from_status,
        job_environment,
        remove_all,
        split_secrets,
    )
    from fiber_core.contract.hookspecs import hookimpl
    from fiber_core.contract.jobs import (
        HOST_LOST_EXITCODE,
        LOG_LIMIT,
        EndReason,
        JobState,
        LogRing,
        Watcher,
    )
    from fiber_core.contract.placement import (
        CAPACITIES,
        ENV_NODE,
        ENV_RESOURCES,
        FALLBACK_WAIT,
        RESOURCE_KEYS,
        Alternative,
        GpuChoice,
        alternative_cost,
        alternatives,
        capacity_kinds,
        capped_workers,
        choice_text,
        gpu_choices,
        job_resources,
        parse_prices,
        resources_env,
        waiting_verdict,
        worker_cost,
    )
    from fiber_core.contract.store import ObjectStore

_EXPORTS = {
    "BackendError": "fiber_core.base.errors",
    "ConfigError": "fiber_core.base.errors",
    "FiberError": "fiber_core.base.errors",
    "install_elsewhere": "fiber_core.base.install",
    "keepalive": "fiber_core.base.net",
    "Option": "fiber_core.base.options",
    "parse_pairs": "fiber_core.base.options",
    "Backend": "fiber_core.contract.backend",
    "Job": "fiber_core.contract.backend",
    "JobSpec": "fiber_core.contract.backend",
    "exitcode_from_status": "fiber_core.contract.helpers",
    "ENV_OPTIONS": "fiber_core.contract.backend",
    "EXTRA_ENV": "fiber_core.contract.backend",
    "TIMEOUT_ALIAS": "fiber_core.contract.backend",
    "clean_name": "fiber_core.contract.helpers",
    "gpu_count": "fiber_core.contract.backend",
    "job_environment": "fiber_core.contract.helpers",
    "remove_all": "fiber_core.contract.helpers",
    "split_secrets": "fiber_core.contract.helpers",
    "HOST_LOST_EXITCODE": "fiber_core.contract.jobs",
    "hookimpl": "fiber_core.contract.hookspecs",
    "ObjectStore": "fiber_core.contract.store",
    "ENV_AUTHKEY": "fiber_core.contract.env",
    "ENV_HUB": "fiber_core.contract.env",
    "ENV_JOB_HOST": "fiber_core.contract.env",
    "ENV_PARENT_PID": "fiber_core.contract.env",
    "ENV_RUN_ID": "fiber_core.contract.env",
    "ENV_TOKEN": "fiber_core.contract.env",
    "ENV_GROUP": "fiber_core.contract.env",
    "ENV_GROUP_INDEX": "fiber_core.contract.env",
    "PER_MEMBER_VARIABLES": "fiber_core.contract.env",
    "SECRET_VARIABLES": "fiber_core.contract.env",
    "LOG_LIMIT": "fiber_core.contract.jobs",
    "ENV_NODE": "fiber_core.contract.placement",
    "ENV_RESOURCES": "fiber_core.contract.placement",
    "RESOURCE_KEYS": "fiber_core.contract.placement",
    "GpuChoice": "fiber_core.contract.placement",
    "choice_text": "fiber_core.contract.placement",
    "gpu_choices": "fiber_core.contract.placement",
    "job_resources": "fiber_core.contract.placement",
    "resources_env": "fiber_core.contract.placement",
    "FALLBACK_WAIT": "fiber_core.contract.placement",
    "CAPACITIES": "fiber_core.contract.placement",
    "Alternative": "fiber_core.contract.placement",
    "alternatives": "fiber_core.contract.placement",
    "capacity_kinds": "fiber_core.contract.placement",
    "alternative_cost": "fiber_core.contract.placement",
    "capped_workers": "fiber_core.contract.placement",
    "parse_prices": "fiber_core.contract.placement",
    "worker_cost": "fiber_core.contract.placement",
    "waiting_verdict": "fiber_core.contract.placement",
    "EndReason": "fiber_core.contract.jobs",
    "JobState": "fiber_core.contract.jobs",
    "LogRing": "fiber_core.contract.jobs",
    "Watcher": "fiber_core.contract.jobs",
}

__all__ = [
    "ENV_AUTHKEY", "ENV_GROUP", "ENV_GROUP_INDEX", "ENV_HUB", "ENV_JOB_HOST", "ENV_PARENT_PID", "ENV_RUN_ID",
    "ENV_OPTIONS", "ENV_TOKEN", "EXTRA_ENV", "HOST_LOST_EXITCODE", "TIMEOUT_ALIAS",
    "LOG_LIMIT", "PER_MEMBER_VARIABLES", "SECRET_VARIABLES", "Backend",
    "BackendError", "ConfigError", "EndReason", "FiberError", "Job", "JobSpec", "JobState", "LogRing", "ObjectStore", "Option",
    "Watcher", "clean_name", "exitcode_from_status", "gpu_count", "hookimpl", "job_environment", "install_elsewhere", "keepalive",
    "parse_pairs", "remove_all", "split_secrets",
    "ENV_NODE", "ENV_RESOURCES", "RESOURCE_KEYS", "GpuChoice", "choice_text", "gpu_choices", "job_resources",
    "resources_env", "FALLBACK_WAIT", "waiting_verdict", "CAPACITIES", "Alternative", "alternatives",
    "capacity_kinds", "alternative_cost", "capped_workers", "parse_prices", "worker_cost",
]


def __getattr__(name: str) -> Any:
    # Each name is loaded on first use, on purpose: a job imports fiber_core.contract.jobs
    # without pluggy (the hooks) or dataclasses (the job spec), ~30 ms of its start.
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fiber_core.contract' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
