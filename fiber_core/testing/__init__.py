"""Test helpers shipped with fiber-core: the backend conformance suite.

A backend plugin proves itself with::

    from fiber_core.testing import BackendConformance

    class TestDocker(BackendConformance):
        backend_name = "docker"
        python = "python3"   # the interpreter inside the jobs
"""

from __future__ import annotations

from typing import Any

__all__ = ["BackendConformance"]


def __getattr__(name: str) -> Any:
    # Imported on demand: jobs import fiber_core.testing.targets without pytest.
    if name == "BackendConformance":
        from fiber_core.testing.conformance import BackendConformance

        return BackendConformance
    raise AttributeError(name)
