"""The one definition of what a backend must do, written once, run per backend.

Subclass :class:`BackendConformance` in a test module of your plugin and set
``backend_name`` (or override the ``backend`` fixture). Every test talks to the
real system the backend drives; nothing is mocked. A backend that truly cannot
support a check overrides that test with ``pytest.skip("why")``, so the reason
shows in the report.
"""

from __future__ import annotations

import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from fiber_core.contract.backend import Backend, Job, JobSpec
from fiber_core.contract.registry import registry
from fiber_core.runtime.config import create_backend
from fiber_core.testing.targets import put_square


class BackendConformance:
    """Behaviour every backend shares. Subclass it; pytest collects the subclass."""

    backend_name: str = "local"
    python: str = sys.executable
    """The interpreter inside jobs (``python3`` in an image)."""
    start_timeout: float = 60.0
    """Seconds a job may take to start and finish a trivial command."""

    @pytest.fixture
    def backend(self) -> Iterator[Backend]:
        """A fresh backend instance; cleaned up after the test."""
        b = create_backend(self.backend_name, "conf" + secrets.token_hex(4))
        try:
            yield b
        finally:
            b.cleanup()

    def spec(self, code: str, **kw: object) -> JobSpec:
        """A job running ``python -c code``."""
        kw.setdefault("name", "conformance")
        return JobSpec(command=[self.python, "-c", code], **kw)  # type: ignore[arg-type]

    def wait(self, backend: Backend, job: Job) -> int | None:
        return backend.wait_for_job(job, self.start_timeout)

    def wait_running(self, backend: Backend, job: Job, marker: str) -> None:
        """Wait until the job has printed ``marker`` (so it is really running)."""
        deadline = time.monotonic() + self.start_timeout
        while marker not in backend.get_job_logs(job):
            assert backend.poll_job(job) is None, backend.get_job_logs(job)
            assert time.monotonic() < deadline, "job did not start in time"
            time.sleep(0.05)

    # -- registration --------------------------------------------------------------

    def test_registered(self, backend: Backend) -> None:
        assert registry.get_class(backend.name) is type(backend)
        for alias in type(backend).aliases:
            assert registry.get_class(alias) is type(backend)

    # -- lifecycle and exit codes ---------------------------------------------------

    def test_exit_zero(self, backend: Backend) -> None:
        job = backend.start_job(self.spec("pass"))
        assert self.wait(backend, job) == 0
        assert backend.poll_job(job) == 0

    def test_exit_code(self, backend: Backend) -> None:
        job = backend.start_job(self.spec("import sys; sys.exit(7)"))
        assert self.wait(backend, job) == 7

    def test_poll_while_running(self, backend: Backend) -> None:
        job = backend.start_job(self.spec("import time; print('up', flush=True); time.sleep(60)"))
        self.wait_running(backend, job, "up")
        assert backend.poll_job(job) is None
        assert backend.wait_for_job(job, 0.2) is None
        backend.kill_job(job)
        assert self.wait(backend, job) is not None

    def test_terminate(self, backend: Backend) -> None:
        job = backend.start_job(self.spec("import time; print('up', flush=True); time.sleep(60)"))
        self.wait_running(backend, job, "up")
        backend.terminate_job(job)
        assert self.wait(backend, job) == -signal.SIGTERM

    def test_kill(self, backend: Backend) -> None:
        job = backend.start_job(self.spec(
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('up', flush=True); time.sleep(60)"))
        self.wait_running(backend, job, "up")
        backend.kill_job(job)
        assert self.wait(backend, job) == -signal.SIGKILL

    def test_terminate_twice_and_after_exit(self, backend: Backend) -> None:
        job = backend.start_job(self.spec("import time; print('up', flush=True); time.sleep(60)"))
        self.wait_running(backend, job, "up")
        backend.terminate_job(job)
        backend.terminate_job(job)
        code = self.wait(backend, job)
        backend.terminate_job(job)
        backend.kill_job(job)
        assert backend.poll_job(job) == code

    # -- environment, logs, network --------------------------------------------------

    def test_env_and_logs(self, backend: Backend) -> None:
        token = secrets.token_hex(8)
        job = backend.start_job(self.spec(
            "import os, sys; print('out', os.environ['CONF_TOKEN']); "
            "print('err', os.environ['CONF_TOKEN'], file=sys.stderr)",
            env={"CONF_TOKEN": token}))
        assert self.wait(backend, job) == 0
        deadline = time.monotonic() + 10
        while True:  # some systems publish logs a moment after the job ends
            logs = backend.get_job_logs(job)
            if f"out {token}" in logs and f"err {token}" in logs or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert f"out {token}" in logs
        assert f"err {token}" in logs

    def test_job_reaches_listen_address(self, backend: Backend) -> None:
        host = backend.get_listen_addr()
        server = socket.create_server((host, 0))
        port = server.getsockname()[1]
        token = secrets.token_hex(8)
        got: list[bytes] = []

        def accept() -> None:
            server.settimeout(self.start_timeout)
            try:
                conn, _ = server.accept()
                got.append(conn.recv(100))
                conn.close()
            except OSError:
                pass

        t = threading.Thread(target=accept)
        t.start()
        job = backend.start_job(self.spec(
            f"import socket; s = socket.create_connection(({host!r}, {port})); s.sendall(b'{token}')"))
        try:
            assert self.wait(backend, job) == 0, backend.get_job_logs(job)
            t.join(self.start_timeout)
            assert got == [token.encode()]
        finally:
            server.close()

    def test_labels_and_name_accepted(self, backend: Backend) -> None:
        spec = self.spec("pass", name="Process-1:2 weird/name",
                         labels={"fiber.run": backend.run_id or "r", "fiber.name": "Process-1:2"})
        job = backend.start_job(spec)
        assert self.wait(backend, job) == 0

    # -- cleanup ---------------------------------------------------------------------

    def test_cleanup_stops_running_jobs(self, backend: Backend) -> None:
        jobs = [backend.start_job(self.spec("import time; print('up', flush=True); time.sleep(120)"))
                for _ in range(2)]
        for job in jobs:
            self.wait_running(backend, job, "up")
        backend.cleanup()
        for job in jobs:
            assert backend.wait_for_job(job, self.start_timeout) is not None
        assert backend.jobs == []

    # -- a whole Fiber process on this backend --------------------------------------

    def test_fiber_process_roundtrip(self, backend: Backend) -> None:
        import fiber_core

        q = fiber_core.Queue()
        p = fiber_core.Process(target=put_square, args=(q, 12), backend=self.backend_name)
        p.start()
        try:
            assert q.get(timeout=self.start_timeout) == 144
            p.join(self.start_timeout)
            assert p.exitcode == 0
        finally:
            if p.is_alive():
                p.kill()
                p.join(self.start_timeout)

