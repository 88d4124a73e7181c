"""The backend recipe of fiber_core.contract.backend's docstring, copied as written."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

from fiber_core.contract import Backend, BackendError, Job, JobSpec, Option, hookimpl


class ShellBackend(Backend):
    name = "shell"
    options = (Option("shell", str, "/bin/sh", "the shell that starts jobs"),)

    def create_job(self, spec: JobSpec) -> Job:
        command = " ".join(map(shlex.quote, spec.command))
        try:
            popen = subprocess.Popen(
                [self.settings["shell"], "-c", "exec " + command],
                env={**os.environ, **spec.env}, cwd=spec.cwd, start_new_session=True,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        except OSError as e:
            raise BackendError(f"cannot run the shell {self.settings['shell']!r}: set "
                               "FIBER_SHELL_SHELL to one that exists", cause=e) from None
        job = Job(id=str(popen.pid), spec=spec, handle=popen)
        threading.Thread(target=self._follow, args=(job,), daemon=True).start()
        return job

    def _follow(self, job: Job) -> None:
        for chunk in iter(lambda: job.handle.stdout.read1(65536), b""):
            job.state.log.append(chunk)
        job.state.finish(job.handle.wait())  # the first end wins; Fiber's stops are STOPPED

    def terminate_job(self, job: Job) -> None:
        self._signal(job, signal.SIGTERM)

    def kill_job(self, job: Job) -> None:
        self._signal(job, signal.SIGKILL)

    def _signal(self, job: Job, sig: int) -> None:
        if not job.state.done():
            try:
                os.killpg(job.handle.pid, sig)  # the job leads its own process group
            except ProcessLookupError:
                pass

    def worker_command(self) -> list[str]:
        return [sys.executable]  # jobs run on this machine


@hookimpl
def fiber_register_backends(register: Callable[[type[Backend]], None]) -> None:
    register(ShellBackend)
