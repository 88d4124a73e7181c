"""The built-in ``local`` backend: each job is a process on this machine.

Registered through the same hook as any plugin. Jobs start a fresh interpreter
(never fork), in their own process group so that terminate and kill reach
everything they started, told this process's pid so that they end the moment it
does (``FIBER_PARENT_PID``), with stdout and stderr kept in a log file (in the run
directory) for :meth:`~fiber_core.contract.backend.Backend.get_job_logs`. A job
SIGKILLed while the kernel counted an out-of-memory kill in this cgroup ended
for :attr:`~fiber_core.contract.jobs.EndReason.OOM`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import Any, NamedTuple

from fiber_core.base.errors import BackendError
from fiber_core.contract.backend import Backend, Job, JobSpec
from fiber_core.contract.env import ENV_PARENT_PID
from fiber_core.contract.hookspecs import hookimpl
from fiber_core.contract.jobs import EndReason


class LocalBackend(Backend):
    """Jobs are child processes of this one."""

    name = "local"
    package = "fiber-core"
    shares_this_machine = True

    def __init__(self, settings: Mapping[str, Any] | None = None, run_id: str = "",
                 rundir: str | None = None) -> None:
        super().__init__(settings, run_id, rundir)
        self._count = 0
        self._lock = threading.Lock()
        self._logdir: str | None = None

    def worker_command(self) -> list[str]:
        return [sys.executable]

    def _log_path(self, name: str) -> str:
        with self._lock:
            if self._logdir is None:
                self._logdir = os.path.join(self.rundir, "logs")
                os.makedirs(self._logdir, exist_ok=True)
            self._count += 1
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:60]
            return os.path.join(self._logdir, f"{self._count}-{safe}.log")

    def create_job(self, spec: JobSpec) -> Job:
        path = self._log_path(spec.name)
        env = {**os.environ, **spec.env, ENV_PARENT_PID: str(os.getpid())}  # a child: it dies with us
        ooms = _oom_kills()
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
        return Job(id=str(popen.pid), spec=spec, handle=_Local(popen, path, ooms),
                   host=socket.gethostname())

    def poll_job(self, job: Job) -> int | None:
        code = job.handle.popen.poll()
        if code is not None and not job.state.done():
            self._finish(job, code)
        return job.state.exitcode

    def wait_for_job(self, job: Job, timeout: float | None = None) -> int | None:
        try:
            code = job.handle.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        if not job.state.done():
            self._finish(job, code)
        return job.state.exitcode

    def _finish(self, job: Job, code: int) -> None:
        if code == -signal.SIGKILL and not job.state.stop_requested and _oom_kills() > job.handle.ooms:
            job.state.finish(code, EndReason.OOM, "killed by the kernel's out-of-memory killer")
        else:
            job.state.finish(code)

    def _signal(self, job: Job, sig: int) -> None:
        popen = job.handle.popen
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
            with open(job.handle.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def cleanup(self) -> None:
        jobs = self.jobs
        super().cleanup()
        for job in jobs:
            try:
                job.handle.popen.wait(5)
            except subprocess.TimeoutExpired:
                pass


class _Local(NamedTuple):
    """``Job.handle`` of a local job."""

    popen: subprocess.Popen
    log_path: str
    ooms: int
    """The cgroup's OOM-kill count when the job started."""


_MEMORY_EVENTS = "/sys/fs/cgroup/memory.events"


def _oom_kills() -> int:
    """How many processes the kernel's OOM killer has killed in this cgroup (0 if unknown)."""
    try:
        with open(_MEMORY_EVENTS, "rb") as f:
            for line in f:
                if line.startswith(b"oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


@hookimpl
def fiber_register_backends(register: Any) -> None:
    register(LocalBackend)
