"""Layer 2, contract: what a backend is, the hooks a plugin implements, the registry.

Everything a backend plugin needs from Fiber is importable from here::

    from fiber_core.contract import Backend, EndReason, Job, JobSpec, Option, hookimpl
"""

from __future__ import annotations

from fiber_core.base.errors import BackendError, ConfigError
from fiber_core.base.net import keepalive
from fiber_core.base.options import Option, parse_pairs
from fiber_core.contract.backend import Backend, Job, JobSpec, exitcode_from_status
from fiber_core.contract.hookspecs import hookimpl
from fiber_core.contract.jobs import LOG_LIMIT, EndReason, JobState, LogRing, Watcher

__all__ = [
    "LOG_LIMIT", "Backend", "BackendError", "ConfigError", "EndReason", "Job", "JobSpec",
    "JobState", "LogRing", "Option", "Watcher", "exitcode_from_status", "hookimpl", "keepalive",
    "parse_pairs",
]
