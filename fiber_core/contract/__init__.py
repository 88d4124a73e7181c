"""Layer 2, contract: what a backend is, the hooks a plugin implements, the registry.

Everything a backend plugin needs from Fiber is importable from here::

    from fiber_core.contract import Backend, EndReason, Job, JobSpec, Option, hookimpl
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BackendError": "fiber_core.base.errors",
    "ConfigError": "fiber_core.base.errors",
    "keepalive": "fiber_core.base.net",
    "Option": "fiber_core.base.options",
    "parse_pairs": "fiber_core.base.options",
    "Backend": "fiber_core.contract.backend",
    "Job": "fiber_core.contract.backend",
    "JobSpec": "fiber_core.contract.backend",
    "exitcode_from_status": "fiber_core.contract.backend",
    "hookimpl": "fiber_core.contract.hookspecs",
    "LOG_LIMIT": "fiber_core.contract.jobs",
    "EndReason": "fiber_core.contract.jobs",
    "JobState": "fiber_core.contract.jobs",
    "LogRing": "fiber_core.contract.jobs",
    "Watcher": "fiber_core.contract.jobs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    # Each name is loaded on first use, on purpose: a job imports fiber_core.contract.jobs
    # without pluggy (the hooks) or dataclasses (the job spec), ~30 ms of its start.
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fiber_core.contract' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
