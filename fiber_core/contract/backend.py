"""The backend contract: what a backend must do to run Fiber's jobs.

A *job* is one running instance of a command somewhere: a local process, a
container, a pod, a process on an SSH host, an AWS Batch job. Every
``fiber_core.Process`` is one job whose command is the worker bootstrap
(``python -m fiber_core.processes.worker``); the bootstrap connects back to the
parent, authenticates, receives the process object and runs it. So a backend
knows nothing of pickling, queues or pools: it starts a command, says when and
why it ended, and stops it.

Writing a backend
-----------------
Subclass :class:`Backend`, set :attr:`Backend.name`, and give it what the
conformance suite (:mod:`fiber_core.testing`) checks:

* :meth:`~Backend.create_job` starts ``spec.command`` with ``spec.env`` and
  returns a :class:`Job` at once;
* every job ends: finish ``job.state`` when the platform says so (a thread that
  waits, a :meth:`~Backend.watch` on an event stream or a batched query), or
  override :meth:`~Backend.poll_job` to ask the platform;
* the job's output goes to ``job.state.log`` (or override
  :meth:`~Backend.get_job_logs`): it is how a job that could not start explains itself;
* :meth:`~Backend.terminate_job` stops a job with ``SIGTERM`` (``-15``) and
  :meth:`~Backend.kill_job` with ``SIGKILL`` (``-9``); the default ``kill_job``
  only terminates, which the suite's ``test_kill`` refuses;
* :meth:`~Backend.worker_command` names the interpreter inside jobs: the
  default, ``python3``, suits images and remote hosts; jobs on this machine use
  ``[sys.executable]``.

Where the platform can tell, two more make a Pool behave better when it comes and goes:
:meth:`~Backend.probe` (does the platform answer now? a Pool waiting to start workers after
a refusal tries again the moment it does) and :meth:`~Backend.crowded_jobs` (jobs placed
over a machine's share while another has room: a Pool moves those workers between tasks).

Then register the class from a plugin module (:mod:`fiber_core.contract.hookspecs`)
and run the suite on it. ``examples/backend_template/fiber_shell.py`` is a whole backend
that runs each job as a process started through a shell, in one module, and passes the
suite as written: ``docs/writing-a-backend.md`` includes it and walks through it, and
``tests/test_authoring.py`` runs that file through the suite.

What the contract gives every backend, so that a plugin keeps only its platform:

* the live-job table: :meth:`~Backend.track_job`, :meth:`~Backend.job_by_id`,
  :attr:`~Backend.jobs` (a job leaves it when its state finishes);
* the settings every backend reads alike: :meth:`~Backend.job_image`,
  :meth:`~Backend.job_env` (``extra_env``), :attr:`~Backend.api_timeout`, and
  :attr:`~Backend.settings` complete and typed once ``__init__`` returns;
* in :mod:`fiber_core.contract.helpers`: :func:`gpu_count` (here),
  :func:`~.helpers.clean_name`, :func:`~.helpers.split_secrets` (what must not be shown),
  :func:`~.helpers.remove_all` (bulk removal at exit), and
  :data:`~fiber_core.contract.jobs.HOST_LOST_EXITCODE`, the one exit code of a lost host.

The rules every method follows
------------------------------
* Methods are called from several threads at once; protect shared state.
* They never block for long: a cluster that does not answer within the
  backend's own timeout is a :class:`~fiber_core.base.errors.BackendError` saying
  what to check, never a hang.
* Exit codes follow :mod:`multiprocessing`: ``None`` while the job runs, the
  command's exit status after, ``-N`` when it was ended by signal ``N``
  (``-15`` after :meth:`Backend.terminate_job`, ``-9`` after
  :meth:`Backend.kill_job`). Use :func:`~.helpers.exitcode_from_status` for systems that
  report ``128 + N``.
* Say *why* a job ended when the platform tells (an eviction, an OOM kill, a
  lost node): ``job.state.finish(code, EndReason.PREEMPTED, "pod evicted")``.
  Fiber marks ``job.state.stop_requested`` before it calls terminate or kill, so
  a plain ``finish(code)`` after those records :attr:`EndReason.STOPPED`.
* Errors from an SDK are wrapped, the fix first and the SDK's chain of exceptions kept out
  of the traceback (see :class:`~fiber_core.base.errors.FiberError`):
  ``raise BackendError("...what failed. What to do...", cause=e) from None``.
"""

from __future__ import annotations

import socket
import threading
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from fiber_core.base.errors import BackendError
from fiber_core.base.options import Option
from fiber_core.contract.env import check_env_settings
from fiber_core.contract.helpers import job_environment
from fiber_core.contract.jobs import EndReason, JobState, Watcher
from fiber_core.contract.placement import (
    Alternative,
    GpuChoice,
    alternatives,
    capacity_kinds,
    choice_text,
    gpu_choices,
    resources_env,
)

__all__ = ["ENV_OPTIONS", "EXTRA_ENV", "TIMEOUT_ALIAS", "Backend", "Job", "JobSpec", "gpu_count"]

EXTRA_ENV = Option("extra_env", list, [], "KEY=VALUE pairs set in every job (not for secrets)")
"""The ``extra_env`` setting: a backend that lists it gets it in :meth:`Backend.job_env`."""

ENV_OPTIONS = (
    Option("env_pass", bool, True, "give jobs this program's environment, as multiprocessing's children get it "
           "(less Fiber's own variables and those of this machine: PATH, HOME, terminal, session, platform; "
           "docs/guarantees.md lists them)"),
    Option("env_exclude", list, [], "variables of this program's environment that jobs do not get: names or "
           "patterns, MY_*,DEBUG"),
    EXTRA_ENV,
    Option("secret_env", list, [], "variables jobs get the way they get the run's key, never in what others "
           "can list (a container's config, a pod spec, a Batch job): WANDB_API_KEY,HF_TOKEN"),
)
"""The settings of a backend that shape its jobs' environments
(:data:`~fiber_core.contract.env.ENV_SETTINGS`): a backend lists them all in its ``options``;
Fiber applies them (:func:`~fiber_core.contract.env.program_environment`) when it builds a
job's ``JobSpec.env`` and ``JobSpec.secret_env``."""

TIMEOUT_ALIAS = Option("timeout", float, None, "deprecated: the former name of api_timeout")
"""The old name of ``api_timeout`` that the ssh and docker backends still read (with a
warning); a backend lists it with ``renamed_options = {"timeout": "api_timeout"}``."""


@dataclass
class JobSpec:
    """Everything a backend needs to start one job. Built by Fiber, read by backends.

    Fields a backend cannot honour (a GPU on the local backend, an image on an
    SSH host) are ignored, unless ignoring them would run the job wrongly; then
    :meth:`Backend.create_job` raises :class:`~fiber_core.base.errors.BackendError`.
    """

    command: list[str]
    """argv of the job: the worker bootstrap, ``[python, "-m", "fiber_core.processes.worker"]``."""
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
    """GPU model (``"a10g"``, ``"v100"``): how it is matched is the backend's choice. With
    several alternatives, the first (the backend reads :attr:`gpu_choices`). Given as a list
    (``["a100", ("l4", 2)]``), it is normalised into :attr:`gpu_choices` when the spec is made."""
    cwd: str | None = None
    """Working directory of the job; ``None`` for the backend's default."""
    volumes: dict[str, str] = field(default_factory=dict)
    """Mounts, ``{source: target}``: a host path or named volume to a path in the job."""
    labels: dict[str, str] = field(default_factory=dict)
    """Metadata to attach where the backend can (container labels, pod labels).
    Always holds ``fiber.run`` (the run id), ``fiber.parent`` and ``fiber.name``."""
    backend_options: dict[str, Any] = field(default_factory=dict)
    """Free-form, backend-specific settings for this job only."""
    gpu_choices: tuple[GpuChoice, ...] = ()
    """The GPU alternatives in order of preference, each a type and its count
    (:func:`~fiber_core.contract.placement.gpu_choices`); filled from :attr:`gpu_type` and
    :attr:`gpu` when not given. More than one only for a backend that sets
    :attr:`Backend.gpu_alternatives`."""

    capacity: str | None = None
    """The capacity kind asked for: ``"spot"``, ``"on-demand"``, ``"spot-then-on-demand"``
    (:data:`~fiber_core.contract.placement.CAPACITIES`), or ``None`` for the platform's own.
    Only for a backend that sets :attr:`Backend.capacity_kinds`."""
    costs: dict[Alternative, float] = field(default_factory=dict)
    """What the job costs per hour on each of its :attr:`alternatives` (on ``Alternative()``
    when it names none) by the ``prices`` setting, where it prices them; :meth:`choosing`
    puts the one chosen in the job's record."""

    secret_env: tuple[str, ...] = ()
    """Names in ``env`` the user marked as secrets (``secret_env``): the backend passes them as
    it passes the run's key (:func:`split_secrets`), never in what others can list."""

    def __post_init__(self) -> None:
        capacity_kinds(self.capacity)  # a bad kind fails when the spec is made
        if not self.gpu_choices and self.gpu_type is not None:
            self.gpu_choices = gpu_choices(self.gpu_type, self.gpu)
        if self.gpu_choices:  # the first alternative, for code that reads one type
            first = self.gpu_choices[0]
            if self.gpu_type != first.type or (self.gpu or 1) != first.count:
                self.gpu_type, self.gpu = first.type, first.count

    @property
    def alternatives(self) -> tuple[Alternative, ...]:
        """Every place the job may run, in the order a backend tries them (GPU alternatives
        within capacity kinds: :func:`~fiber_core.contract.placement.alternatives`)."""
        return alternatives(self.gpu_choices, self.capacity)

    def choosing(self, choice: GpuChoice | Alternative | None, *, capacity: str | None = None,
                 cost_per_hour: float | None = None) -> JobSpec:
        """This spec for one of its alternatives: that GPU type and count only (none for
        ``None``), that capacity kind, and the environment entry that tells the job what it
        got (``current_process().resources``)."""
        gpu = choice.gpu if isinstance(choice, Alternative) else choice
        if isinstance(choice, Alternative) and choice.capacity:
            capacity = choice.capacity
        if cost_per_hour is None:  # the backend's own price (an SSH host's label) wins over the table
            cost_per_hour = self.costs.get(Alternative(gpu, capacity))
        env = {**self.env, **resources_env(gpu, gpu=self.gpu or 0, capacity=capacity,
                                           cost_per_hour=cost_per_hour)}
        if gpu is None:
            return replace(self, capacity=capacity, env=env)
        return replace(self, gpu_type=gpu.type, gpu=gpu.count, gpu_choices=(gpu,), capacity=capacity, env=env)


@dataclass(eq=False)
class Job:
    """A started job. Created by :meth:`Backend.create_job`, passed back to the backend.

    ``id`` is the backend's own identifier (a pid, a container id, a pod name).
    ``handle`` holds whatever the backend needs (a Popen, an SDK object).
    ``host`` names the machine it runs on, when known: jobs with the same
    ``host`` share that machine's memory and files. ``state`` is its record:
    exit code, why it ended, its log.
    """

    id: str
    spec: JobSpec
    handle: Any = None
    host: str | None = None
    state: JobState = field(default_factory=JobState)
    channel: socket.socket | None = field(default=None, repr=False)
    """The parent's end of a connection to the job's worker that the backend made and handed
    down itself (the local backend's socket pair), or None: the worker then dials the parent.
    Nobody else can reach such a connection, so it needs no handshake. Taken once by the
    parent's process machinery (:meth:`take_channel`)."""

    def take_channel(self) -> socket.socket | None:
        """:attr:`channel`, which the job holds no longer."""
        channel, self.channel = self.channel, None
        return channel

    @property
    def exitcode(self) -> int | None:
        """The exit code once the job ended (``state.exitcode``), else ``None``."""
        return self.state.exitcode


def gpu_count(spec: JobSpec) -> int:
    """How many GPUs ``spec`` asks for: ``spec.gpu``, one when it names only a ``gpu_type``
    (``-1``, every GPU of a node, stays ``-1``)."""
    return spec.gpu or (1 if spec.gpu_type else 0)


class Backend(ABC):
    """Starts, watches and stops jobs on one kind of infrastructure.

    One instance exists per process that starts jobs (the program's main process,
    and any job that itself starts processes). It is created by Fiber with the
    backend's resolved settings, the run id and the run's directory, and closed
    with :meth:`cleanup` when the process exits.

    Class attributes a subclass sets:

    ``name``
        The name users select it by: ``FIBER_BACKEND=<name>``. Lowercase.
    ``aliases``
        Other accepted names (``("k8s",)`` for ``kubernetes``).
    ``options``
        The :class:`~fiber_core.base.options.Option` settings it reads, namespaced by
        ``name``: ``[<name>] key`` in ``.fiberconfig``, ``FIBER_<NAME>_KEY`` in
        the environment. Resolved values arrive in :attr:`settings`.
    ``package``
        The distribution that provides it, shown by ``fiber backends``.
    ``shares_this_machine``
        True when jobs run as plain processes of this machine, on its CPUs and its
        filesystem (the local backend). A Pool then starts its workers at most one
        per CPU at a time, so the first is ready sooner instead of all of them
        sharing the CPUs while they start; a manager serves on a Unix socket.
    ``starts_per_cpu``
        With ``shares_this_machine``: how many jobs per CPU a Pool may have starting at
        once (1; the local backend's forks from its template, a tenth of an
        interpreter's start each, 8).
    ``spare_jobs``
        How many spare jobs of each kind to keep ready when the user does not set
        ``spare_jobs`` (:mod:`fiber_core.processes.spares`): started ahead after a
        ``Process.start()``, so that the next one runs on a job already running.
        0 (the default) where an idle job costs money or room others need, or where
        jobs start as fast as a fork; 1 where a start is slow and an idle worker
        is cheap (Docker, SSH). A spare is a job like any other for the backend: it is
        started with :meth:`create_job` (named ``spare``), and let go by closing its
        connection, after which its worker exits with code 0.
    ``config_section``
        Where its options live when the name cannot be used (``aws-batch`` has a
        dash, which environment variable names cannot hold): ``"aws"`` gives
        ``[aws]`` and ``FIBER_AWS_*``. Defaults to ``name``.
    ``renamed_options``
        ``{old: new}`` for settings that were renamed: a value set under the old name
        (still listed in ``options``, default ``None``) is used for the new one, with a
        :class:`FutureWarning`, unless the new one is set too.

    The settings every backend reads the same way: ``image`` (:meth:`job_image`),
    the environment's (:data:`ENV_OPTIONS`: ``env_pass``, ``env_exclude``, ``extra_env``,
    ``secret_env``; Fiber applies them to ``JobSpec.env``, :meth:`job_env` applies
    ``extra_env`` again for a spec made by hand) and ``api_timeout`` (:attr:`api_timeout`:
    seconds one call to the platform may take). A backend whose jobs run elsewhere lists
    :data:`ENV_OPTIONS` and passes ``JobSpec.secret_env`` with the run's key.
    """

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    options: ClassVar[tuple[Option, ...]] = ()
    package: ClassVar[str | None] = None
    config_section: ClassVar[str | None] = None
    shares_this_machine: ClassVar[bool] = False
    spare_jobs: ClassVar[int] = 0
    renamed_options: ClassVar[Mapping[str, str]] = {}
    gpu_alternatives: ClassVar[bool] = False
    """True when the backend tries a job's GPU alternatives (``JobSpec.gpu_choices``) in
    order, or ignores GPUs altogether; a job with several is refused by any other."""
    capacity_kinds: ClassVar[bool] = False
    """True when the backend places a job on the capacity kind it asks for
    (``JobSpec.capacity``: spot, on-demand, spot then on-demand), or has no such kinds to
    choose from (the local backend); a job that asks is refused by any other."""

    starts_per_cpu: int = 1

    peer_timeout: float = 30.0
    """Seconds after which a TCP peer that stopped answering counts as gone (the
    ``peer_timeout`` setting, set by Fiber): for the backend's own long-lived
    connections, with :func:`fiber_core.base.net.keepalive`."""

    @classmethod
    def settings_section(cls) -> str:
        """The configuration section of this backend's options."""
        return cls.config_section or cls.name

    def __init__(self, settings: Mapping[str, Any] | None = None, run_id: str = "",
                 rundir: str | None = None) -> None:
        """``settings`` holds options of :attr:`options` (Fiber passes each one, resolved);
        ``run_id`` is unique per run; ``rundir`` is a private directory of this process,
        removed when it exits. Once it returns, :attr:`settings` holds every option, typed
        (a missing one has its default), and renamed options are applied."""
        self.settings: dict[str, Any] = self.complete_settings(settings or {})
        check_env_settings(self.settings, f"[{self.settings_section()}]")
        self.run_id = run_id
        self._rundir = rundir
        self._own_rundir: str | None = None
        self._jobs: dict[str, Job] = {}  # the live jobs, by id: see track_job
        self._jobs_lock = threading.Lock()
        self._watchers: list[Watcher] = []
        self._closing = False

    @classmethod
    def complete_settings(cls, given: Mapping[str, Any]) -> dict[str, Any]:
        """Every option's value, typed: what ``given`` holds, else the default; renamed
        options applied (:attr:`renamed_options`). What :attr:`settings` holds; for
        :meth:`clean`, which gets the settings without an instance."""
        section = cls.settings_section()
        settings = dict(given)
        for o in cls.options:
            settings[o.name] = o.parse(settings.get(o.name, o.default), f"{o.name} in [{section}]", "settings")
        defaults = {o.name: o.default for o in cls.options}
        for old, new in cls.renamed_options.items():
            if settings.get(old) is None:
                continue
            warnings.warn(f"the {section} setting {old!r} is now called {new!r} (FIBER_{section.upper()}_"
                          f"{new.upper()}, [{section}] {new}): the old name will go", FutureWarning, stacklevel=3)
            if settings.get(new) == defaults.get(new):
                settings[new] = settings[old]
        return settings

    @property
    def rundir(self) -> str:
        """A private directory (mode 0700) for the backend's files on this machine, such as logs.

        Fiber's run directory, removed when the process exits; for a backend made
        without one (tests), a temporary directory that :meth:`cleanup` removes.
        """
        if self._rundir is None:
            import tempfile  # only a backend made without Fiber's run directory needs it

            with self._jobs_lock:
                if self._own_rundir is None:
                    self._own_rundir = tempfile.mkdtemp(prefix=f"fiber-{self.name}-")
                self._rundir = self._own_rundir
        return self._rundir

    # -- what a backend must implement ------------------------------------------

    @abstractmethod
    def create_job(self, spec: JobSpec) -> Job:
        """Start a job running ``spec.command`` and return at once.

        Must not wait for the job to reach any state beyond *accepted by the
        cluster*: a job waiting for capacity (a pending pod, a RUNNABLE Batch job)
        is started, not failed. Raise :class:`~fiber_core.base.errors.BackendError`
        when the job cannot be started at all (unreachable cluster, missing image),
        with a message that says what to fix.
        """

    @abstractmethod
    def terminate_job(self, job: Job) -> None:
        """Ask the job to stop (``SIGTERM`` or the platform's equivalent) and return.

        Idempotent: terminating a finished or already-terminated job does nothing
        and raises nothing. After it the exit code is ``-15`` where the platform
        can tell.
        """

    # -- what a backend may override ---------------------------------------------

    def poll_job(self, job: Job) -> int | None:
        """Return ``None`` while the job runs (or waits to run), else its exit code.

        The default reads ``job.state``, which the backend finishes when it learns
        the job ended. Called often: a backend that overrides it to ask its
        platform answers from a cache kept fresh by one watch or one batched query
        per run (a :meth:`watch`), not one request per call, and finishes
        ``job.state`` when it sees the end. A job the cluster lost (node gone, pod
        evicted) is finished: a non-zero code, negative if a signal is known, and
        the reason.
        """
        return job.state.exitcode

    create_concurrency: int = 1
    """How many :meth:`create_job` calls the default :meth:`create_jobs` makes at once.

    1 (the default) calls them one after another. A backend whose ``create_job``
    is thread-safe and mostly waits on the network (an API request, an SSH
    channel) sets it higher, as an attribute or a property read from a setting:
    it bounds the requests in flight, so a group start does not flood the API.
    """

    def create_jobs(self, specs: Sequence[JobSpec]) -> list[Job]:
        """Start several jobs in one call; return them in the order of ``specs``.

        The default calls :meth:`create_job` for each, :attr:`create_concurrency`
        at a time. Backends whose platform starts many jobs in one request (AWS
        Batch array jobs) override it. All or nothing: when it raises, no job of
        the call is left running (each one made is killed).
        """
        limit = max(1, int(self.create_concurrency))
        jobs: list[Job] = []
        if limit == 1 or len(specs) <= 1:
            try:
                for spec in specs:
                    jobs.append(self.create_job(spec))
            except BaseException:
                self._kill_all(jobs)
                raise
            return jobs
        from concurrent.futures import ThreadPoolExecutor  # only for a group start

        errors: list[BaseException] = []
        with ThreadPoolExecutor(min(limit, len(specs)), thread_name_prefix="fiber-create") as ex:
            futures = [ex.submit(self.create_job, spec) for spec in specs]
            for f in futures:
                error = f.exception()
                if error is None:
                    jobs.append(f.result())
                else:
                    errors.append(error)
        if errors:
            self._kill_all(jobs)
            raise errors[0]
        return jobs

    def _kill_all(self, jobs: list[Job]) -> None:
        for job in jobs:
            try:
                job.state.stop_requested = True
                self.kill_job(job)
            except Exception:
                pass

    def kill_job(self, job: Job) -> None:
        """Stop the job at once (``SIGKILL``); its exit code is then ``-9`` where the platform
        can tell. Defaults to :meth:`terminate_job`: override it when the platform can
        do better, or the conformance suite's ``test_kill`` fails."""
        self.terminate_job(job)

    def wait_for_job(self, job: Job, timeout: float | None = None) -> int | None:
        """Block until the job ends or ``timeout`` seconds pass; return :meth:`poll_job`.

        The default wakes as soon as ``job.state`` is finished, and meanwhile polls
        with a backoff from 1 ms to 100 ms (for backends that override
        :meth:`poll_job`). Backends with a native wait (``Popen.wait``) may override it.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while True:
            code = self.poll_job(job)
            if code is not None:
                return code
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                delay = min(delay, left)
            job.state.wait(delay)
            delay = min(delay * 2, 0.1)

    def get_job_logs(self, job: Job) -> str:
        """What the job wrote to stdout and stderr, as far as the backend keeps it.

        Used to explain a job that died before it reached its parent. The default
        returns ``job.state.log``; a job with no output yet (not scheduled, say)
        gives ``""``, never an error.
        """
        return job.state.log.text()

    def crowded_jobs(self) -> list[Job]:
        """Jobs that would better run elsewhere now: placed where they crowd a machine
        (over its share, when every machine was full or one was lost) while another has room.

        A Pool asks about once a second and lets such a worker go between its tasks, after
        starting another, which the backend places where there is room: so the work moves
        back onto a machine that came back. Fast, no I/O (it is asked under the pool's
        lock). The default, none, suits platforms that place jobs themselves.
        """
        return []

    def probe(self) -> bool | None:
        """Whether the platform answers now: one cheap call with a short timeout (a ping).

        A Pool whose backend refused to start workers (a daemon restarting, an API away)
        probes it a few times a second while it waits for its next try, and tries again
        as soon as this returns True; False means not yet. The default, ``None`` (cannot
        tell), leaves the Pool on its backoff schedule. Never raises.
        """
        return None

    def warm_up(self) -> None:
        """The run is under way in the program's first process: start ahead, without
        waiting for it, what this backend's first job will need.

        Called once, when the run selects this backend (its hub starting, or its first
        job), never in a job. The local backend starts its template here: it imports while
        the program (or the Pool that started the run) goes on, and the first workers fork
        from it sooner. The default does nothing. Never raises and never blocks on the
        platform.
        """
        return None

    def get_listen_addr(self) -> str:
        """The host or IP address that jobs use to reach this process.

        Fiber binds its listener on this address. The default, ``127.0.0.1``,
        suits backends whose jobs share this machine's network (local, Docker with
        host networking). Remote backends return an address routable from the
        jobs, or raise :class:`~fiber_core.base.errors.BackendError` explaining what to
        configure (``listen_host``).
        """
        return "127.0.0.1"

    def worker_command(self) -> list[str]:
        """The argv prefix that starts a Python interpreter inside a job.

        Fiber appends ``-m fiber_core.processes.worker``. The ``python`` setting
        overrides it. The default, ``python3``, suits images and remote hosts; a
        backend whose jobs share this machine returns ``[sys.executable]``.
        """
        return ["python3"]

    def cleanup(self) -> None:
        """Release everything this backend created in this run.

        Called once when the process exits (normally or by an exception), and
        safe to call twice. The default stops the backend's watchers, kills every
        tracked job that is still running, and removes the temporary directory it
        made. Backends that leave objects behind finished jobs (stopped
        containers, completed pods) override it, take what is tracked with
        :meth:`take_jobs`, and call ``super().cleanup()``.
        """
        with self._jobs_lock:
            watchers, self._watchers = self._watchers, []
        for watcher in watchers:
            watcher.stop()
        for job in self.take_jobs():
            try:
                if self.poll_job(job) is None:
                    job.state.stop_requested = True
                    self.kill_job(job)
            except Exception:
                pass
        if self._own_rundir is not None:
            import shutil  # see rundir

            shutil.rmtree(self._own_rundir, ignore_errors=True)

    @classmethod
    def clean(cls, settings: Mapping[str, Any], run_id: str | None = None) -> list[str]:
        """Remove what crashed runs left behind (``fiber clean --backend NAME``).

        Removes the jobs of ``run_id``, or of every Fiber run when ``None``, and
        returns a description of each thing removed. The default removes nothing.
        """
        return []

    # -- helpers for backends ---------------------------------------------------------

    @property
    def api_timeout(self) -> float:
        """Seconds one call to the platform may take before it is an error (``api_timeout``)."""
        return float(self.settings.get("api_timeout") or 30.0)

    def job_image(self, spec: JobSpec, default: str | None = None, hint: str = "") -> str:
        """The image of a job: ``spec.image`` (``Process(image=...)``, the global ``image``
        setting), else this backend's ``image`` setting, else ``default``; if none, a
        :class:`BackendError` that says what to set, followed by ``hint``."""
        image = spec.image or self.settings.get("image") or default
        if image:
            return str(image)
        section = self.settings_section()
        raise BackendError(f"no image for {self.name} jobs: set FIBER_{section.upper()}_IMAGE (or [{section}] "
                           "image in .fiberconfig, or the global image setting) to an image that has Python "
                           f"3 and fiber-core installed{hint}")

    def job_env(self, spec: JobSpec) -> dict[str, str]:
        """A job's environment: the ``extra_env`` setting, then ``spec.env`` over it.

        It holds the run's secrets (:func:`split_secrets` tells them apart).
        """
        return job_environment(spec.env, self.settings.get("extra_env"), f"[{self.settings_section()}]")

    def track_job(self, job: Job) -> Job:
        """Put ``job`` in the live-job table (:meth:`job_by_id`, :attr:`jobs`) until it ends.

        Fiber tracks every job it starts once :meth:`create_job` returns; a backend whose
        watcher must find a job by id earlier (an event may come before ``create_job``
        returns) calls this as soon as it has the id. A finish hook on ``job.state``
        takes it out of the table when it ends.
        """
        self._insert(job)
        return job

    def _insert(self, job: Job) -> bool:
        """Add ``job`` to the live-job table; False once cleanup has taken the table."""
        with self._jobs_lock:
            if self._closing:
                return False
            if job.id in self._jobs or job.state.done():
                return True
            self._jobs[job.id] = job
        job.state.add_done_callback(lambda _state: self.untrack_job(job))
        return True

    def rename_job(self, job: Job, new_id: str) -> None:
        """Give a live job the id of the platform object that now runs it (a pod made again
        for another GPU alternative, a Batch job submitted to the next queue): from now on
        :meth:`job_by_id` finds it by ``new_id`` only."""
        with self._jobs_lock:
            if self._jobs.get(job.id) is job:
                del self._jobs[job.id]
                self._jobs[new_id] = job
            job.id = new_id

    def job_by_id(self, job_id: str) -> Job | None:
        """The live job with this id, or ``None`` (not started here, ended, or cleaned up)."""
        with self._jobs_lock:
            return self._jobs.get(job_id)

    def watch(self, step: Callable[[], float | None], name: str, interval: float = 1.0,
              max_backoff: float = 30.0) -> Watcher:
        """Start a :class:`~fiber_core.contract.jobs.Watcher` that :meth:`cleanup` stops."""
        watcher = Watcher(step, f"fiber-{self.name}-{name}", interval, max_backoff)
        with self._jobs_lock:
            self._watchers.append(watcher)
        return watcher

    def take_jobs(self) -> list[Job]:
        """Stop tracking every job and return them (for :meth:`cleanup`).

        From then on the backend is closing: a job Fiber starts afterwards (a pool
        replacing a worker while the program exits) is stopped at once and refused.
        """
        with self._jobs_lock:
            jobs, self._jobs = list(self._jobs.values()), {}
            self._closing = True
        return jobs

    @property
    def jobs(self) -> list[Job]:
        """The jobs started in this run that have not ended, in the order they started."""
        with self._jobs_lock:
            return list(self._jobs.values())

    # -- called by Fiber; not for backends to override ----------------------------

    def start_jobs(self, specs: Sequence[JobSpec]) -> list[Job]:
        """Start jobs through :meth:`create_jobs` and track them for :meth:`cleanup`."""
        for spec in specs[:1]:  # a group's members ask for the same hardware
            self._check_choices(spec)
        jobs = self.create_jobs(specs)
        self._track(jobs)
        return jobs

    def start_job(self, spec: JobSpec) -> Job:
        """Start one job through :meth:`create_job` and track it for :meth:`cleanup`."""
        self._check_choices(spec)
        job = self.create_job(spec)
        self._track([job])
        return job

    def _check_choices(self, spec: JobSpec) -> None:
        """Refuse GPU alternatives that this backend would not try in order."""
        if len(spec.gpu_choices) > 1 and not self.gpu_alternatives:
            raise BackendError(
                f"the {self.name} backend cannot try GPU types in order ({spec.name} asks for "
                f"{choice_text(spec.gpu_choices)}): ask for one type, or run it on a backend that "
                "tries alternatives (kubernetes, aws-batch, ssh)")
        if spec.capacity is not None and not self.capacity_kinds:
            raise BackendError(
                f"the {self.name} backend cannot choose spot or on-demand capacity ({spec.name} asks for "
                f"capacity={spec.capacity!r}): leave capacity unset, or run it on a backend that can "
                "(kubernetes, aws-batch, ssh)")

    def _track(self, jobs: list[Job]) -> None:
        if not all([self._insert(job) for job in jobs]):  # cleanup ran: nothing would ever stop these
            for job in jobs:
                try:
                    self.stop_job(job, force=True)
                except Exception:
                    pass
            raise BackendError(f"the {self.name} backend was cleaned up (the program is exiting): "
                               "no new job starts")

    def stop_job(self, job: Job, force: bool = False) -> None:
        """Mark the end as asked for by Fiber, then :meth:`kill_job` or :meth:`terminate_job`."""
        job.state.stop_requested = True
        if force:
            self.kill_job(job)
        else:
            self.terminate_job(job)

    def untrack_job(self, job: Job) -> None:
        """Stop tracking ``job``, which has ended: :meth:`cleanup` need not look at it."""
        with self._jobs_lock:
            if self._jobs.get(job.id) is job:
                del self._jobs[job.id]

    def end_reason(self, job: Job) -> EndReason | None:
        """Why ``job`` ended (``None`` while it runs or when the backend cannot tell)."""
        return job.state.reason if job.state.done() else None

