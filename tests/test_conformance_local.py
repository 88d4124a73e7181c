"""The backend conformance suite, run on the built-in local backend."""

from fiber_core.testing import BackendConformance


class TestLocalBackend(BackendConformance):
    backend_name = "local"
