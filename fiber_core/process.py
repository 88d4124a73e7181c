"""``fiber_core.process``: the names of :mod:`multiprocessing.process`, for job-backed processes."""

from __future__ import annotations

from fiber_core.processes.process import (
    BaseProcess,
    Process,
    active_children,
    current_process,
    parent_process,
)

__all__ = ["BaseProcess", "Process", "active_children", "current_process", "parent_process"]
