"""Test helpers shipped with fiber-core: the backend conformance suite.

A backend plugin proves itself with::

    from fiber_core.testing import BackendConformance

    class TestDocker(BackendConformance):
        backend_name = "docker"
        python = "python3"      # the interpreter inside the jobs
        start_timeout = 120.0   # the bound of each wait

``docs/writing-a-backend.md`` walks through writing a backend and proving it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BackendConformance", "service_missing"]


def service_missing(reason: str) -> None:
    """Skip a test whose real service is not up, or fail it under CI (``CI`` set).

    CI starts every service first, so a missing one there is a broken run, not a
    reason for tests to pass without testing anything.
    """
    import os  # imported by jobs: keep it light

    import pytest  # only in test processes: job images often lack pytest

    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: the services must be up)")
    pytest.skip(reason)


def __getattr__(name: str) -> Any:
    # Imported on demand: jobs import fiber_core.testing.targets without pytest.
    if name == "BackendConformance":
        from fiber_core.testing.conformance import (
            BackendConformance,  # pytest: only in test processes
        )

        return BackendConformance
    raise AttributeError(name)
