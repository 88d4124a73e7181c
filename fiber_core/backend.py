"""The backend contract: what a backend must do to run Fiber's jobs.

A *job* is one running instance of a command somewhere: a local process, a
container, a pod, a process on an SSH host, an AWS Batch job. Every
``fiber_core.Process`` is one job whose command is the worker bootstrap
(``python -m fiber_core.worker``); the bootstrap connects back to the parent,
authenticates, receives the process object and runs it. So a backend knows
nothing of pickling, queues or pools: it starts a command, reports whether it is
still running, and stops it.

Writing a backend
-----------------
Subclass :class:`Backend`, set :attr:`Backend.name`, implement the three
abstract methods, and register the class from a plugin module (see
:mod:`fiber_core.hookspecs`)::

    class NomadBackend(Backend):
        name = "nomad"
        options = (Option("address", str, "http://127.0.0.1:4646", "Nomad API"),)

        def create_job(self, spec):
            job_id = self.client.submit(spec.command, env=spec.env, ...)
            return Job(id=job_id, spec=spec)

        def poll_job(self, job):
            state = self.client.status(job.id)
            return None if state.running else state.exit_code

        def terminate_job(self, job):
            self.client.stop(job.id)

Prove it with the conformance suite shipped in :mod:`fiber_core.testing`.

The rules every method follows
------------------------------
* Methods are called from several threads at once; protect shared state.
* They never block for long: a cluster that does not answer within the
  backend's own timeout is a :class:`~fiber_core.errors.BackendError` saying
  what to check, never a hang.
* Exit codes follow :mod:`multiprocessing`: ``None`` while the job runs, the
  command's exit status after, ``-N`` when it was ended by signal ``N``
  (``-15`` after :meth:`Backend.terminate_job`, ``-9`` after
  :meth:`Backend.kill_job`). Use :func:`exitcode_from_status` for systems that
  report ``128 + N``.
* Errors from an SDK are wrapped: ``raise BackendError("...what to do...") from e``.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fiber_core.config import Option

__all__ = ["Backend", "Job", "JobSpec", "Option", "exitcode_from_status"]


@dataclass
class JobSpec:
    """Everything a backend needs to start one job. Built by Fiber, read by backends.

    Fields a backend cannot honour (a GPU on the local backend, an image on an
    SSH host) are ignored, unless ignoring them would run the job wrongly; then
    :meth:`Backend.create_job` raises :class:`~fiber_core.errors.BackendError`.
    """

    command: list[str]
    """argv of the job: the worker bootstrap, ``[python, "-m", "fiber_core.worker"]``."""
    name: str = "fiber-job"
    """Human-readable name (the Process name); not unique. Backends may sanitise it."""
    image: str | None = None
    """Container image, for container backends; ``None`` means the backend's default."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables to set in the job, on top of the backend's defaults.
    Contains the run's authentication key: never log or display it."""
    cpu: float | None = None
    """CPUs to reserve (may be fractional); ``None`` for the backend's default."""
    memory: int | None = None
    """Memory limit in MiB; ``None`` for the backend's default."""
    gpu: int | None = None
    """Number of GPUs; ``None`` or 0 for none. ``-1`` means every GPU of the node."""
    gpu_type: str | None = None
    """GPU model (``"a10g"``, ``"v100"``): how it is matched is the backend's choice."""
    cwd: str | None = None
    """Working directory of the job; ``None`` for the backend's default."""
    volumes: dict[str, str] = field(default_factory=dict)
    """Mounts, ``{source: target}``: a host path or named volume to a path in the job."""
    labels: dict[str, str] = field(default_factory=dict)
    """Metadata to attach where the backend can (container labels, pod labels).
    Always holds ``fiber.run`` (the run id), ``fiber.parent`` and ``fiber.name``."""
    backend_options: dict[str, Any] = field(default_factory=dict)
    """Free-form, backend-specific settings for this job only."""


@dataclass(eq=False)
class Job:
    """A started job. Created by :meth:`Backend.create_job`, passed back to the backend.

    ``id`` is the backend's own identifier (a pid, a container id, a pod name).
    ``handle`` holds whatever the backend needs (a Popen, an SDK object).
    ``host`` names where it runs, when known.
    """

    id: str
    spec: JobSpec
    handle: Any = None
    host: str | None = None
    exitcode: int | None = None
    """Cached final exit code, set by :meth:`Backend.wait_for_job` once known."""


def exitcode_from_status(status: int | None) -> int | None:
    """Map a shell-style status (``128 + N`` for signal ``N``) to ``multiprocessing``'s ``-N``."""
    if status is not None and 128 < status < 128 + 65:
        return -(status - 128)
    return status


class Backend(ABC):
    """Starts, watches and stops jobs on one kind of infrastructure.

    One instance exists per process that starts jobs (the program's main process,
    and any job that itself starts processes). It is created by Fiber with the
    backend's resolved settings and the run id, and closed with :meth:`cleanup`
    when the process exits.

    Class attributes a subclass sets:

    ``name``
        The name users select it by: ``FIBER_BACKEND=<name>``. Lowercase.
    ``aliases``
        Other accepted names (``("k8s",)`` for ``kubernetes``).
    ``options``
        The :class:`~fiber_core.config.Option` settings it reads, namespaced by
        ``name``: ``[<name>] key`` in ``.fiberconfig``, ``FIBER_<NAME>_KEY`` in
        the environment. Resolved values arrive in :attr:`settings`.
    ``package``
        The distribution that provides it, shown by ``fiber backends``.
    ``shares_this_machine``
        True when jobs run as plain processes of this machine, on its CPUs and its
        filesystem (the local backend). A Pool then starts its workers at most one
        per CPU at a time, so the first is ready sooner instead of all of them
        sharing the CPUs while they start; a manager serves on a Unix socket.
    ``config_section``
        Where its options live when the name cannot be used (``aws-batch`` has a
        dash, which environment variable names cannot hold): ``"aws"`` gives
        ``[aws]`` and ``FIBER_AWS_*``. Defaults to ``name``.
    """

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    options: ClassVar[tuple[Option, ...]] = ()
    package: ClassVar[str | None] = None
    config_section: ClassVar[str | None] = None
    shares_this_machine: ClassVar[bool] = False

    @classmethod
    def settings_section(cls) -> str:
        """The configuration section of this backend's options."""
        return cls.config_section or cls.name

    def __init__(self, settings: Mapping[str, Any] | None = None, run_id: str = "") -> None:
        """``settings`` holds every option of :attr:`options`, typed; ``run_id`` is unique per run."""
        self.settings: dict[str, Any] = dict(settings or {})
        self.run_id = run_id
        self._jobs: list[Job] = []
        self._jobs_lock = threading.Lock()

    # -- what a backend must implement ------------------------------------------

    @abstractmethod
    def create_job(self, spec: JobSpec) -> Job:
        """Start a job running ``spec.command`` and return at once.

        Must not wait for the job to reach any state beyond *accepted by the
        cluster*. Raise :class:`~fiber_core.errors.BackendError` when the job
        cannot be started at all (unreachable cluster, missing image), with a
        message that says what to fix.
        """

    @abstractmethod
    def poll_job(self, job: Job) -> int | None:
        """Return ``None`` while the job runs (or waits to run), else its exit code.

        Called often: backends that talk to a remote API answer from a cache kept
        fresh by one watch or one batched query per run, not one request per call.
        A job the cluster lost (node gone, pod evicted) is finished: return a
        non-zero code, negative if a signal is known.
        """

    @abstractmethod
    def terminate_job(self, job: Job) -> None:
        """Ask the job to stop (``SIGTERM`` or the platform's equivalent) and return.

        Idempotent: terminating a finished or already-terminated job does nothing
        and raises nothing. After it the exit code is ``-15`` where the platform
        can tell.
        """

    # -- what a backend may override ---------------------------------------------

    def kill_job(self, job: Job) -> None:
        """Stop the job at once (``SIGKILL``). Defaults to :meth:`terminate_job`."""
        self.terminate_job(job)

    def wait_for_job(self, job: Job, timeout: float | None = None) -> int | None:
        """Block until the job ends or ``timeout`` seconds pass; return :meth:`poll_job`.

        The default polls with a backoff from 1 ms to 100 ms. Backends with a
        native wait (``Popen.wait``, a watch) override it.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while True:
            code = self.poll_job(job)
            if code is not None:
                job.exitcode = code
                return code
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                delay = min(delay, left)
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def get_job_logs(self, job: Job) -> str:
        """What the job wrote to stdout and stderr, as far as the backend keeps it.

        Used to explain a job that died before it reached its parent. The default
        returns ``""``.
        """
        return ""

    def get_listen_addr(self) -> str:
        """The host or IP address that jobs use to reach this process.

        Fiber binds its listener on this address. The default, ``127.0.0.1``,
        suits backends whose jobs share this machine's network (local, Docker with
        host networking). Remote backends return an address routable from the
        jobs, or raise :class:`~fiber_core.errors.BackendError` explaining what to
        configure (``listen_host``).
        """
        return "127.0.0.1"

    def worker_command(self) -> list[str]:
        """The argv prefix that starts a Python interpreter inside a job.

        Fiber appends ``-m fiber_core.worker``. The ``python`` setting overrides it.
        """
        return ["python3"]

    def cleanup(self) -> None:
        """Release everything this backend created in this run.

        Called once when the process exits (normally or by an exception), and
        safe to call twice. The default terminates every job started through
        :meth:`start_job` that is still running. Backends that leave objects
        behind finished jobs (stopped containers, completed pods) remove them here.
        """
        with self._jobs_lock:
            jobs, self._jobs = self._jobs, []
        for job in jobs:
            try:
                if self.poll_job(job) is None:
                    self.kill_job(job)
            except Exception:
                pass

    @classmethod
    def clean(cls, settings: Mapping[str, Any], run_id: str | None = None) -> list[str]:
        """Remove what crashed runs left behind (``fiber clean --backend NAME``).

        Removes the jobs of ``run_id``, or of every Fiber run when ``None``, and
        returns a description of each thing removed. The default removes nothing.
        """
        return []

    # -- called by Fiber; not for backends to override ----------------------------

    def start_job(self, spec: JobSpec) -> Job:
        """Start a job through :meth:`create_job` and remember it for :meth:`cleanup`."""
        job = self.create_job(spec)
        with self._jobs_lock:
            self._jobs.append(job)
        return job

    def forget_job(self, job: Job) -> None:
        """Stop tracking ``job``, which has ended: :meth:`cleanup` need not look at it."""
        with self._jobs_lock:
            try:
                self._jobs.remove(job)
            except ValueError:
                pass

    @property
    def jobs(self) -> list[Job]:
        """The jobs started in this run that are still tracked."""
        with self._jobs_lock:
            return list(self._jobs)
