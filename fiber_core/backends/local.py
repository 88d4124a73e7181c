"""The built-in ``local`` backend: each job is a process on this machine.

Registered through the same hook as any plugin. A Fiber worker job is forked from
a template process that has Fiber imported already (never from this process:
see :mod:`fiber_core.backends.template`), any other command starts as it is; either
way in its own process group so that terminate and kill reach
everything they started, told this process's pid so that they end the moment it
does (``FIBER_PARENT_PID``), with stdout and stderr kept in a log file (in the run
directory) for :meth:`~fiber_core.contract.backend.Backend.get_job_logs`. A job
SIGKILLed while the kernel counted an out-of-memory kill in this cgroup ended
for :attr:`~fiber_core.contract.jobs.EndReason.OOM`; one SIGKILLed while the count
stood still, for :attr:`~fiber_core.contract.jobs.EndReason.KILLED`
(:mod:`fiber_core.base.oom`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from fiber_core.backends.early import OPTIONS, SECTION, adopt, template_env
from fiber_core.backends.template import Request, Template, TemplateError
from fiber_core.base.errors import BackendError
from fiber_core.base.log import log
from fiber_core.base.oom import oom_kills
from fiber_core.contract.backend import Backend, Job, JobSpec
from fiber_core.contract.env import ENV_PARENT_PID
from fiber_core.contract.hookspecs import hookimpl
from fiber_core.contract.jobs import EndReason
from fiber_core.contract.placement import resources_env

_NO_GPU = resources_env(None)
"""What a local job got: no GPU of its own (it shares this machine's), whatever it asked."""


class LocalBackend(Backend):
    """Jobs are child processes of this one."""

    name = SECTION
    package = "fiber-core"
    shares_this_machine = True
    gpu_alternatives = True  # it ignores GPU requests: no alternative is chosen over another
    capacity_kinds = True  # this machine is one kind: a request for one is not refused, nor served
    options = OPTIONS

    def __init__(self, settings: Mapping[str, Any] | None = None, run_id: str = "",
                 rundir: str | None = None) -> None:
        super().__init__(settings, run_id, rundir)
        self._count = 0
        self._lock = threading.Lock()
        self._logdir: str | None = None
        self._template: Template | None = None
        self._template_failed = False
        if self.settings.get("start", "template") == "template":
            self.starts_per_cpu = STARTS_PER_CPU

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
        return self._create([spec])[0]

    def create_jobs(self, specs: Sequence[JobSpec]) -> list[Job]:
        """Fork the workers among ``specs`` from the template, all requests sent at once;
        start the rest (and any the template could not fork) as new interpreters. A subclass
        that overrides :meth:`create_job` gets each spec through it, as the contract says."""
        if type(self).create_job is not LocalBackend.create_job:
            return [self.create_job(spec) for spec in specs]
        return self._create(specs)

    def _create(self, specs: Sequence[JobSpec]) -> list[Job]:
        forks = [i for i, spec in enumerate(specs) if self._forkable(spec)]
        jobs: list[Job | None] = [None] * len(specs)
        try:
            # A template that is starting is waited for: it started when the run chose this
            # backend, so it is ready sooner than a new interpreter would be, which would also
            # take CPU from it.
            template = self._template_for(wait=True) if forks else None
            if template is not None:
                ooms = oom_kills()
                for chunk in range(0, len(forks), _FORK_CHUNK):
                    mine = forks[chunk:chunk + _FORK_CHUNK]
                    for i, job in zip(mine, self._fork(template, [specs[i] for i in mine], ooms)):
                        jobs[i] = job
            for i, spec in enumerate(specs):
                if jobs[i] is None:
                    jobs[i] = self._popen(spec)
        except BaseException:
            self._kill_all([job for job in jobs if job is not None])
            raise
        return [job for job in jobs if job is not None]

    def _forkable(self, spec: JobSpec) -> bool:
        """A worker of this interpreter, on a backend whose jobs share this machine (a forked
        job reaches its parent on a channel, never through the hub)."""
        return (self.settings.get("start", "template") == "template" and not self._template_failed
                and self.shares_this_machine and list(spec.command) == [sys.executable, "-m", _WORKER])

    def _fork(self, template: Template, specs: Sequence[JobSpec], ooms: int | None) -> list[Job | None]:
        """Fork ``specs`` from ``template``, each with a channel to this process; None for
        each one the template could not fork."""
        env = template_env()
        paths = [self._log_path(spec.name) for spec in specs]
        pairs: list[tuple[socket.socket, socket.socket]] = []
        files = []
        try:
            requests = []
            for spec, path in zip(specs, paths):
                files.append(open(path, "wb"))  # noqa: SIM115 - closed below, once the template has it
                pairs.append(socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM))
                requests.append(Request({**env, **spec.env}, spec.cwd or os.getcwd(), _WORKER,
                                        files[-1].fileno(), pairs[-1][1].fileno()))
            answers = template.start(requests)
        except BaseException:
            for ours, _ in pairs:
                ours.close()
            raise
        finally:
            for f in files:
                f.close()
            for _, theirs in pairs:
                theirs.close()
        host = socket.gethostname()
        out: list[Job | None] = []
        for spec, path, (ours, _), answer in zip(specs, paths, pairs, answers):
            if isinstance(answer, TemplateError):
                ours.close()
                self._template_lost(str(answer))
                out.append(None)
            else:
                out.append(Job(id=str(answer.pid), spec=spec, handle=_Local(answer, path, ooms),  # type: ignore[arg-type]
                               host=host, channel=ours))
        return out

    def _popen(self, spec: JobSpec) -> Job:
        path = self._log_path(spec.name)
        env = {**os.environ, **spec.env, **_NO_GPU, ENV_PARENT_PID: str(os.getpid())}  # a child: it dies with us
        ooms = oom_kills()
        try:
            with open(path, "wb") as logfile:
                popen = subprocess.Popen(
                    spec.command, env=env, cwd=spec.cwd, stdin=subprocess.DEVNULL,
                    stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True,
                )
        except OSError as e:
            raise BackendError(
                f"cannot start {spec.command[0]!r} for {spec.name}: check the python setting "
                "(FIBER_PYTHON) or the job's command", cause=e) from None
        return Job(id=str(popen.pid), spec=spec, handle=_Local(popen, path, ooms),
                   host=socket.gethostname())

    def _template_for(self, wait: bool = False) -> Template | None:
        """The template to fork workers from (it starts with the first): once it is ready,
        or, with ``wait``, when it gets ready within :data:`_TEMPLATE_WAIT` seconds."""
        with self._lock:
            if self._template is None and not self._template_failed:
                preload = list(self.settings.get("preload") or [])
                try:
                    self._template = (adopt(preload, self._template_lost)
                                      or Template(sys.executable, template_env(), preload, self._template_lost))
                except TemplateError as e:
                    self._template_failed = True
                    log.warning("fiber: %s; local jobs start as new interpreters", e)
            template = self._template
        if template is None or self._template_failed:
            return None
        if wait:
            return template if template.wait_ready(_TEMPLATE_WAIT) else None
        return template if template.ready.is_set() else None

    def warm_up(self) -> None:
        """Start the template now (it imports for about as long as a new interpreter's
        start): a Pool made later in the run forks its workers from it at once."""
        if self.settings.get("start", "template") == "template":
            self._template_for()

    def wait_template(self, timeout: float | None = None) -> bool:
        """Start the template if it is not started, and wait until it is ready; False if it
        is not ready within ``timeout`` or cannot start (jobs then start fresh)."""
        self._template_for()
        template = self._template
        return template is not None and not self._template_failed and template.wait_ready(timeout)

    def _template_lost(self, why: str) -> None:
        with self._lock:
            if self._template_failed:
                return
            self._template_failed = True
        log.warning("fiber: %s; local jobs start as new interpreters from now on", why)

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
        if code != -signal.SIGKILL or job.state.stop_requested or job.handle.ooms is None:
            job.state.finish(code)
            return
        now = oom_kills()
        if now is None:
            job.state.finish(code)
        elif now > job.handle.ooms:
            job.state.finish(code, EndReason.OOM, "killed by the kernel's out-of-memory killer")
        else:
            job.state.finish(code, EndReason.KILLED)  # the kernel counted no out-of-memory kill

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
        with self._lock:
            template, self._template = self._template, None
        if template is not None:
            template.close()


_WORKER = "fiber_core.processes.worker"


STARTS_PER_CPU = 8
"""Workers per CPU a Pool may have starting at once when they fork from the template. Each
costs about 10 ms of CPU (its own and this process's) to get ready, a tenth of a new
interpreter's: 8 per CPU delay the first result by tens of milliseconds, and a big Pool
then starts at the speed of the CPUs instead of one start's latency after another."""


_TEMPLATE_WAIT = 30.0
"""Seconds a group start waits for a template that is starting before it starts its jobs as
new interpreters: a template is one such start (with the worker's imports and the preload),
so only one whose preload hangs or takes longer than a job's whole life makes this matter."""


_FORK_CHUNK = 32
"""Jobs a group start asks the template for at once: each holds a log file and a socket pair
open in this process until the template has them, so a Pool of 512 needs no more than 96
descriptors for it."""


class _Local(NamedTuple):
    """``Job.handle`` of a local job."""

    popen: subprocess.Popen  # or a template's ForkedJob, which has the same parts
    log_path: str
    ooms: int | None
    """The cgroup's OOM-kill count when the job started (None: it cannot be read)."""


@hookimpl
def fiber_register_backends(register: Any) -> None:
    register(LocalBackend)
