"""Test helpers shipped with fiber-core: the backend conformance suite.

A backend plugin proves itself with::

    from fiber_core.testing import BackendConformance

    class TestDocker(BackendConformance):
        backend_name = "docker"
        python = "python3"   # the interpreter inside the jobs
"""

from fiber_core.testing.conformance import BackendConformance

__all__ = ["BackendConformance"]
