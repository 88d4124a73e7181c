"""The built-in ``local`` backend: each job is a process on this machine.

Registered through the same hook as any plugin. Jobs start a fresh interpreter
(never fork), in their own process group so that terminate and kill reach
everything they started, with stdout and stderr kept in a log file for
:meth:`~fiber_core.backend.Backend.get_job_logs`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

from fiber_core.backend import Backend, Job, JobSpec
from fiber_core.errors import BackendError
from fiber_core.hookspecs import hookimpl


class LocalBackend(Backend):
    """Jobs are child processes of this one."""

    name = "local"
    package = "fiber-core"
    shares_this_machine = True

    def __init__(self, settings=None, run_id: str = "") -> None:  # noqa: ANN001
        super().__init__(settings, run_id)
        self._count = 0
        self._lock = threading.Lock()
        self._logdir: str | None = None

    def worker_command(self) -> list[str]:
        return [sys.executable]

    def _log_path(self, name: str) -> str:
        with self._lock:
            if self._logdir is None:
                from fiber_core.runtime import runtime

                self._logdir = os.path.join(runtime().rundir, "logs")
                os.makedirs(self._logdir, exist_ok=True)
            self._count += 1
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:60]
            return os.path.join(self._logdir, f"{self._count}-{safe}.log")

    def create_job(self, spec: JobSpec) -> Job:
        path = self._log_path(spec.name)
        env = {**os.environ, **spec.env}
        try:
            with open(path, "wb") as logfile:
                popen = subprocess.Popen(
                    spec.command, env=env, cwd=spec.cwd, stdin=subprocess.DEVNULL,
                    stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True,
                )
        except OSError as e:
            raise BackendError(
                f"cannot start {spec.command[0]!r} for {spec.name}: {e.strerror or e}. "
                "Check the python setting (FIBER_PYTHON) or the job's command."
            ) from e
        return Job(id=str(popen.pid), spec=spec, handle=(popen, path), host=socket.gethostname())

    def poll_job(self, job: Job) -> int | None:
        return job.handle[0].poll()

    def wait_for_job(self, job: Job, timeout: float | None = None) -> int | None:
        try:
            code = job.handle[0].wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        job.exitcode = code
        return code

    def _signal(self, job: Job, sig: int) -> None:
        popen = job.handle[0]
        if popen.poll() is not None:
            return
        try:
            os.killpg(popen.pid, sig)  # the job leads its own group
        except ProcessLookupError:
            pass

    def terminate_job(self, job: Job) -> None:
        self._signal(job, signal.SIGTERM)

    def kill_job(self, job: Job) -> None:
        self._signal(job, signal.SIGKILL)

    def get_job_logs(self, job: Job) -> str:
        try:
            with open(job.handle[1], "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def cleanup(self) -> None:
        jobs = self.jobs
        super().cleanup()
        for job in jobs:
            try:
                job.handle[0].wait(5)
            except subprocess.TimeoutExpired:
                pass


@hookimpl
def fiber_register_backends(register) -> None:  # noqa: ANN001
    register(LocalBackend)
