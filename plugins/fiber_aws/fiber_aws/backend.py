"""The ``aws-batch`` backend: every Fiber job is an AWS Batch job.

:meth:`AwsBatchBackend.create_job` picks the job queue from the job's hardware (the CPU
queue, or the queue configured for its GPU type), finds or registers a job definition for
its image and resources, and submits the job with the worker command and environment.
The run's key is not in that environment (``DescribeJobs`` shows it to anyone allowed to
call it): it is an SSM SecureString parameter of the run, which the job definition's
``secrets`` name and the ECS execution role injects; the parameter is deleted, and those
job definitions deregistered, at exit (``key_from = environment`` puts it back in the
environment, for platforms that cannot inject secrets).
One poller per backend (a :class:`~fiber_core.contract.Watcher`) keeps the status of every
unfinished job of the run with batched ``DescribeJobs`` calls and finishes each job's
:class:`~fiber_core.contract.JobState` with its exit code and why it ended
(:func:`end_reason`).

boto3 takes a second to import and set up, so it is imported when a backend is created,
never when the plugin is loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import math
import os
import re
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fiber_core.base.log import log
from fiber_core.contract import (
    ENV_AUTHKEY,
    ENV_GROUP,
    ENV_GROUP_INDEX,
    PER_MEMBER_VARIABLES,
    Backend,
    BackendError,
    ConfigError,
    EndReason,
    Job,
    JobSpec,
    Option,
    Watcher,
    exitcode_from_status,
    parse_pairs,
)

SECTION = "aws"
"""Configuration section: ``[aws]`` in ``.fiberconfig``, ``FIBER_AWS_*``, ``init(aws_...)``."""

DEFAULT_LOG_GROUP = "/aws/batch/job"
DEFAULT_VCPUS = 1
DEFAULT_MEMORY = 2048  # MiB
CLEAN_REASON = "fiber clean: left behind by a crashed run"

OPTIONS: tuple[Option, ...] = (
    Option("region", str, None, "AWS region of the job queues (default: the boto3 chain, e.g. AWS_DEFAULT_REGION)"),
    Option("queue", str, None, "job queue for CPU jobs"),
    Option("gpu_queues", list, [], "job queue per GPU type: a10g:QUEUE,v100:QUEUE; the type is matched "
           "case-insensitively against meta(gpu_type=...)"),
    Option("image", str, None, "container image of the jobs (default: the global image setting)"),
    Option("job_role", str, None, "ARN of the IAM role the jobs run as (their own AWS credentials)"),
    Option("log_group", str, DEFAULT_LOG_GROUP, "CloudWatch Logs group the jobs log to (another group is set in "
           "the job definition with the awslogs driver)"),
    Option("extra_env", list, [], "KEY=VALUE pairs set in every job"),
    Option("key_from", str, "ssm", "how jobs get the run's key: ssm (a SecureString parameter of the run "
           "that the job definition's secrets inject; needs execution_role) or environment (visible to "
           "anyone allowed batch:DescribeJobs)", choices=("ssm", "environment")),
    Option("execution_role", str, None, "ARN of the ECS execution role that injects the run's key "
           "(ssm:GetParameters on parameter/fiber/*)"),
    Option("endpoint_url", str, None, "endpoint for Batch, CloudWatch Logs and EC2 (an emulator in tests)"),
    Option("poll_interval", float, 1.0, "seconds between two DescribeJobs rounds of the poller"),
    Option("runnable_timeout", float, 1800.0,
           "seconds a job may wait for capacity (SUBMITTED/PENDING/RUNNABLE) before Fiber terminates it and "
           "fails the process with an explanation; 0: forever"),
    Option("api_timeout", float, 30.0, "seconds one AWS API call may take before it is an error"),
)

_QUEUED = ("SUBMITTED", "PENDING", "RUNNABLE")
_FINAL = ("SUCCEEDED", "FAILED")
_MAX_BACKOFF = 30.0
_MAX_ARRAY = 10_000  # children of one array job
_LOST_AFTER = 3  # DescribeJobs rounds without the job before it counts as lost...
_LOST_GRACE = 60.0  # ...and seconds after submission (new jobs may not be visible at once)
_THROTTLED = {"ThrottlingException", "Throttling", "TooManyRequestsException",
              "RequestLimitExceeded", "SlowDown"}
_CREDENTIAL_WORDS = re.compile(r"secret|access_?key|session_?token|password|credential", re.I)
_AWS_CREDENTIAL_ENV = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}
_ACCESS_KEY_ID = re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b")
_TAG_CHARS = re.compile(r"[^\w .:/=+\-@]")
_SPOT_ENVIRONMENTS = ("SPOT", "FARGATE_SPOT")

# What Batch says when a job ends (statusReason, and the container's reason), by EndReason.
_OOM = re.compile(r"OutOfMemoryError", re.I)
_NOT_STARTED = re.compile(r"CannotPullContainerError|CannotStartContainerError|"
                          r"ResourceInitializationError|CannotCreateVolumeError|Task failed to start")
_HOST_LOST = re.compile(r"Host EC2 \(instance [^)]*\) (?:terminated|stopped)", re.I)
_SPOT_WORDS = re.compile(r"spot|interrupt", re.I)


class _AwsError(Exception):
    """A failed AWS call, stripped of botocore's types (so this module need not import them)."""

    def __init__(self, operation: str, code: str, message: str, unreachable: bool = False) -> None:
        super().__init__(f"{operation}: {code}: {message}" if code else f"{operation}: {message}")
        self.code = code
        self.message = message
        self.throttled = code in _THROTTLED
        self.unreachable = unreachable
        """The endpoint did not answer (no connection, or a timeout): no permission is at fault."""


@dataclass(eq=False)
class BatchJob:
    """What the poller knows of one Batch job beyond its ``JobState``: the ``handle`` of its :class:`Job`."""

    job_name: str
    queue: str
    memory: int
    """The memory limit it was submitted with, MiB."""
    submitted: float = field(default_factory=time.monotonic)
    described: dict[str, Any] = field(default_factory=dict)
    """Its latest ``DescribeJobs`` entry (``{}`` before the first)."""
    log_stream: str | None = None
    stop_reason: str | None = None
    """The reason Fiber gave when it terminated the job."""
    note: str | None = None
    """Fiber's own explanation of a failure (no capacity, job lost)."""
    missing: int = 0

    @property
    def status(self) -> str:
        return str(self.described.get("status", "SUBMITTED"))


def _container(described: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job's ``container`` and its last attempt's, from a ``DescribeJobs`` entry."""
    attempts = described.get("attempts") or [{}]
    return described.get("container") or {}, attempts[-1].get("container") or {}


def exit_status(described: Mapping[str, Any]) -> int | None:
    """The container's exit status in a ``DescribeJobs`` entry (``128 + N`` after signal ``N``)."""
    container, attempt = _container(described)
    status = container.get("exitCode", attempt.get("exitCode"))
    return None if status is None else int(status)


def end_reason(described: Mapping[str, Any], *, stop_reason: str | None = None,
               memory: int | None = None, spot: bool = False) -> tuple[EndReason, str]:
    """Why a finished Batch job ended, and what Batch said, from its ``DescribeJobs`` entry.

    Reads the job's ``statusReason`` and its container's ``reason``: Fiber's own stop
    (``stop_reason``, the reason it gave ``TerminateJob``, or ``fiber clean``'s) is
    STOPPED; ``OutOfMemoryError`` is OOM (with the ``memory`` limit in MiB);
    ``CannotPullContainerError``, ``CannotStartContainerError``,
    ``ResourceInitializationError`` ("Task failed to start") and a job that never got a
    start time or an exit code (cancelled while RUNNABLE) are NEVER_STARTED; a lost host
    ("Host EC2 (instance i-...) terminated.") is PREEMPTED when its compute environment is
    ``spot`` or Batch speaks of a spot interruption, else HOST_LOST; every other end is
    EXITED.
    """
    container, attempt = _container(described)
    status_reason = described.get("statusReason") or ""
    said = "; ".join(r for r in (status_reason, container.get("reason") or attempt.get("reason")) if r)
    if described.get("status") == "SUCCEEDED":
        return EndReason.EXITED, said
    if status_reason and status_reason in (stop_reason, CLEAN_REASON):
        return EndReason.STOPPED, said
    if _OOM.search(said):
        resources = {r.get("type"): r.get("value") for r in container.get("resourceRequirements") or []}
        limit = resources.get("MEMORY") or container.get("memory") or memory
        return EndReason.OOM, said + (f" (memory limit {limit} MiB)" if limit else "")
    if _NOT_STARTED.search(said):
        return EndReason.NEVER_STARTED, said
    if _SPOT_WORDS.search(said):
        return EndReason.PREEMPTED, said
    if _HOST_LOST.search(said):
        return (EndReason.PREEMPTED if spot else EndReason.HOST_LOST), said
    if described.get("startedAt") is None or exit_status(described) is None:
        return EndReason.NEVER_STARTED, said
    return EndReason.EXITED, said


def parse_gpu_queues(entries: list[str]) -> dict[str, str]:
    """``["a10g:queue-a", "V100:queue-b"]`` to ``{"a10g": "queue-a", "v100": "queue-b"}``."""
    out: dict[str, str] = {}
    for entry in entries:
        gpu_type, sep, queue = entry.partition(":")
        if not sep or not gpu_type.strip() or not queue.strip():
            raise ConfigError(
                f"bad gpu_queues entry {entry!r} in [{SECTION}]: expected GPU_TYPE:QUEUE, "
                "e.g. gpu_queues = a10g:gpu-a10g-queue,v100:gpu-v100-queue"
            )
        out[gpu_type.strip().lower()] = queue.strip()
    return out


def _refuse_credentials(settings: Mapping[str, Any]) -> None:
    """Fail if anything that looks like an AWS credential reached fiber's configuration."""
    advice = ("AWS credentials are never read from fiber's configuration: remove it and use the "
              "standard boto3 chain (AWS_PROFILE, ~/.aws/credentials, AWS_ACCESS_KEY_ID and "
              "AWS_SECRET_ACCESS_KEY in the environment, an instance or task role)")
    prefixes = ("FIBER_AWS_", "FIBER_AWS-BATCH_")
    found = [f"environment variable {k}" for k in os.environ
             if k.upper().startswith(prefixes) and _CREDENTIAL_WORDS.search(k.split("_", 2)[-1])]
    found += [f"setting {k!r}" for k in settings
              if k not in {o.name for o in OPTIONS} and _CREDENTIAL_WORDS.search(k)]
    for item in settings.get("extra_env") or []:
        name = item.partition("=")[0].strip()
        if name.upper() in _AWS_CREDENTIAL_ENV or _ACCESS_KEY_ID.search(item):
            found.append(f"{name} in [{SECTION}] extra_env (give the jobs a job_role instead)")
    for key, value in settings.items():
        if key != "extra_env" and isinstance(value, str) and _ACCESS_KEY_ID.search(value):
            found.append(f"an access key id in setting {key!r}")
    if found:
        raise ConfigError(f"refusing AWS credentials in fiber's configuration ({'; '.join(found)}). {advice}.")


def _local_ipv4_addresses() -> list[ipaddress.IPv4Address]:
    """The IPv4 address of each network interface of this machine (Linux), without any traffic."""
    try:
        import fcntl
        import struct
    except ImportError:
        return []
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                     struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            out.append(ipaddress.IPv4Address(packed[20:24]))
    return out


def _sanitise_tag(text: str, limit: int) -> str:
    return _TAG_CHARS.sub("_", text)[:limit]


def _group_spec(specs: Sequence[JobSpec]) -> JobSpec | None:
    """The one spec an array job's children can all run for a group started by Fiber
    (``Backend.start_jobs`` of a Pool's workers), else None.

    The members differ only in their names and in the variables each derives from the
    group and its index (``PER_MEMBER_VARIABLES``). The common spec leaves those out
    and sets the index in each child from Batch's own (``AWS_BATCH_JOB_ARRAY_INDEX``;
    the child's job id ``PARENT:INDEX`` where that is missing).
    """
    first = specs[0]
    group = first.env.get(ENV_GROUP)
    if not group:
        return None

    def common_part(s: JobSpec) -> JobSpec:
        env = {k: v for k, v in s.env.items() if k not in PER_MEMBER_VARIABLES}
        labels = {k: v for k, v in s.labels.items() if k != "fiber.name"}
        return dataclasses.replace(s, name=first.name, env=env, labels=labels)

    base = common_part(first)
    for i, s in enumerate(specs):
        if s.env.get(ENV_GROUP) != group or s.env.get(ENV_GROUP_INDEX) != str(i) or common_part(s) != base:
            return None
    index = "${AWS_BATCH_JOB_ARRAY_INDEX:-${AWS_BATCH_JOB_ID##*:}}"
    command = ["/bin/sh", "-c", f'export {ENV_GROUP_INDEX}="{index}"; exec "$@"', "fiber-array", *base.command]
    return dataclasses.replace(base, command=command)


class AwsBatchBackend(Backend):
    """Runs each job as an AWS Batch job; a GPU job goes to the queue of its GPU type.

    Settings come from the ``[aws]`` section (``FIBER_AWS_*``): the section is ``aws``,
    not the backend's name, because a dash cannot appear in an environment variable
    set from a shell. Job definitions are registered on demand, one per distinct image
    and resources, and reused across runs. While the backend has unfinished jobs, one
    poller (:meth:`watch`) asks ``DescribeJobs`` about them, up to 100 ids a call, backs
    off when throttled, and finishes each job's state when Batch reports its end, so
    :meth:`poll_job` and :meth:`wait_for_job` (the defaults) never call AWS. AWS Batch
    has one way to stop a job (``TerminateJob``: ``SIGTERM``, then ``SIGKILL`` after the
    ECS stop timeout), so :meth:`kill_job` is :meth:`terminate_job`.
    """

    name = "aws-batch"
    aliases = ("aws",)
    package = "fiber-aws"
    options = OPTIONS
    config_section = SECTION
    describe_batch = 100
    """Job ids per DescribeJobs call (the API takes at most 100)."""

    def __init__(self, settings: Mapping[str, Any] | None = None, run_id: str = "",
                 rundir: str | None = None) -> None:
        super().__init__(settings, run_id, rundir)
        for o in OPTIONS:  # settings made by hand may lack an option, or hold strings as from a file
            self.settings[o.name] = o.parse(self.settings.get(o.name, o.default), f"{SECTION}_{o.name}",
                                            "settings")
        _refuse_credentials(self.settings)
        self.gpu_queues = parse_gpu_queues(self.settings["gpu_queues"])
        self.extra_env = parse_pairs(self.settings["extra_env"], f"extra_env in [{SECTION}]")
        self._lock = threading.Lock()
        self._pending: dict[str, Job] = {}
        """Unfinished jobs by id: what the poller asks about."""
        self._poller: Watcher | None = None
        self._errors_shown: set[str] = set()
        self._jobdef_lock = threading.Lock()
        self._jobdefs: dict[str, str] = {}
        self._count = 0
        self._networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] | None = None
        self._spot: dict[str, bool] = {}
        self._key_parameter: str | None = None  # the SSM parameter holding the run's key, once made
        self._key_value: str | None = None
        self._secret_jobdefs: list[str] = []  # job definitions naming that parameter: deregistered at cleanup
        self._session, self._client_config = self._session_and_config()
        self._clients: dict[str, Any] = {}
        self.batch = self.client("batch")
        """The boto3 Batch client."""

    # -- set-up ----------------------------------------------------------------------

    def _session_and_config(self) -> tuple[Any, Any]:
        import boto3
        from botocore.config import Config

        region = self.settings["region"]
        session = boto3.session.Session(region_name=region) if region else boto3.session.Session()
        if not session.region_name:
            raise BackendError(
                "no AWS region for the aws-batch backend: set [aws] region in .fiberconfig "
                "(FIBER_AWS_REGION), or AWS_DEFAULT_REGION / a profile's region for boto3"
            )
        if session.get_credentials() is None:
            raise BackendError(
                "no AWS credentials found: the aws-batch backend uses boto3's standard chain only. "
                "Set AWS_PROFILE, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or run where an "
                "instance or task role provides them (never in fiber's configuration)"
            )
        self.region = session.region_name
        timeout = self.settings["api_timeout"]
        return session, Config(connect_timeout=timeout, read_timeout=timeout, max_pool_connections=16,
                               retries={"mode": "standard", "max_attempts": 3})

    def client(self, service: str) -> Any:
        """The boto3 client for ``service`` ("batch", "logs", "ec2"), created on first use."""
        with self._lock:
            if service not in self._clients:
                self._clients[service] = self._session.client(
                    service, config=self._client_config, endpoint_url=self.settings["endpoint_url"])
            return self._clients[service]

    def _call(self, client: Any, operation: str, **kwargs: Any) -> dict[str, Any]:
        """One AWS call; botocore's errors become :class:`_AwsError`."""
        from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError
        from botocore.exceptions import ConnectionError as BotoConnectionError

        try:
            return getattr(client, operation)(**kwargs)
        except ClientError as e:
            err = e.response.get("Error", {})
            raise _AwsError(operation, err.get("Code", ""), err.get("Message", str(e))) from e
        except BotoCoreError as e:
            unreachable = isinstance(e, (BotoConnectionError, HTTPClientError))
            raise _AwsError(operation, type(e).__name__, str(e), unreachable) from e

    def _error(self, e: _AwsError, failed: str, fix: str) -> BackendError:
        """A failed call as the BackendError to raise: what failed, what to do, then the cause's
        summary (botocore's error). An endpoint that did not answer has its own fix."""
        if e.unreachable:
            fix = (f"{self._where()} does not answer; check the network, the region ([aws] region) "
                   "and [aws] endpoint_url (FIBER_AWS_ENDPOINT_URL)")
        cause = e.__cause__ if isinstance(e.__cause__, Exception) else e
        return BackendError(f"{failed}: {fix}", cause=cause)

    def _where(self) -> str:
        endpoint = self.settings["endpoint_url"]
        return f"AWS Batch in {self.region}" + (f" at {endpoint}" if endpoint else "")

    def _environments(self, queues: list[str]) -> list[dict[str, Any]]:
        """The compute environments of the job queues ``queues``."""
        names: list[str] = []
        for q in self._call(self.batch, "describe_job_queues", jobQueues=queues)["jobQueues"]:
            names += [o["computeEnvironment"] for o in q.get("computeEnvironmentOrder", [])]
        if not names:
            return []
        return self._call(self.batch, "describe_compute_environments",
                          computeEnvironments=sorted(set(names)))["computeEnvironments"]

    # -- routing and job definitions ---------------------------------------------------

    def queue_for(self, spec: JobSpec) -> tuple[str, int]:
        """The job queue for ``spec`` and its GPU count; BackendError if none is configured."""
        gpus = spec.gpu or 0
        if gpus < 0:
            raise BackendError(
                f"{spec.name} asks for gpu={gpus} (every GPU of the node); AWS Batch needs a count: "
                "request gpu=N"
            )
        if spec.gpu_type and not gpus:
            gpus = 1
        if not gpus:
            if not self.settings["queue"]:
                raise BackendError(
                    f"no job queue for CPU jobs ({spec.name}): set [aws] queue in .fiberconfig "
                    "(FIBER_AWS_QUEUE) to an AWS Batch job queue"
                )
            return self.settings["queue"], 0
        configured = ", ".join(f"{t} -> {q}" for t, q in self.gpu_queues.items()) or "none"
        if spec.gpu_type is None:
            if len(self.gpu_queues) == 1:
                return next(iter(self.gpu_queues.values())), gpus
            raise BackendError(
                f"{spec.name} asks for {gpus} GPU(s) without a GPU type, and the GPU queues are "
                f"({configured}): say which with meta(gpu_type=...) or configure exactly one "
                "in [aws] gpu_queues"
            )
        queue = self.gpu_queues.get(spec.gpu_type.lower())
        if queue is None:
            raise BackendError(
                f"no job queue for GPU type {spec.gpu_type!r} ({spec.name}); configured GPU "
                f"queues: {configured}. Add one to [aws] gpu_queues (FIBER_AWS_GPU_QUEUES="
                f"{spec.gpu_type.lower()}:QUEUE,...) or request a configured type"
            )
        return queue, gpus

    # -- the run's key ------------------------------------------------------------------

    def key_parameter(self, value: str) -> str:
        """The name of the SSM SecureString parameter that holds the run's key ``value``,
        created on first use: ``/fiber/<run>/<random>/authkey``. The job definitions name it
        in ``secrets``, so the key is in no job's description."""
        with self._jobdef_lock:
            if self._key_parameter is not None:
                if value != self._key_value:
                    raise BackendError("a job carries another run's key than this backend's: start it "
                                       "from a backend of its run")
                return self._key_parameter
            if not self.settings["execution_role"]:
                raise BackendError(
                    "the aws-batch backend passes the run's key through SSM Parameter Store, which "
                    "needs an ECS execution role: set [aws] execution_role (FIBER_AWS_EXECUTION_ROLE) to "
                    "the ARN of a role with ssm:GetParameters on arn:aws:ssm:*:*:parameter/fiber/*, or "
                    "set key_from = environment (FIBER_AWS_KEY_FROM), which lets anyone allowed "
                    "batch:DescribeJobs read the key and reach this process")
            run = re.sub(r"[^A-Za-z0-9_.-]", "-", self.run_id) or "run"
            name = f"/fiber/{run}/{os.urandom(4).hex()}/authkey"
            try:
                self._call(self.client("ssm"), "put_parameter", Name=name, Value=value, Type="SecureString",
                           Description=f"fiber: the key of run {self.run_id}",
                           Tags=[{"Key": "fiber.run", "Value": _sanitise_tag(self.run_id, 256)}])
            except _AwsError as e:
                raise self._error(e, f"cannot store the run's key in SSM Parameter Store ({name}) on "
                                  f"{self._where()}", "allow ssm:PutParameter and ssm:DeleteParameter "
                                  "on parameter/fiber/* to these credentials, or set key_from = "
                                  "environment") from None
            self._key_parameter, self._key_value = name, value
            return name

    def _drop_key(self) -> None:
        """Delete the run's parameter and deregister the job definitions that name it."""
        with self._jobdef_lock:
            name, self._key_parameter, self._key_value = self._key_parameter, None, None
            jobdefs, self._secret_jobdefs = self._secret_jobdefs, []
            for key in [k for k, arn in self._jobdefs.items() if arn in jobdefs]:
                del self._jobdefs[key]
        for arn in jobdefs:
            try:
                self._call(self.batch, "deregister_job_definition", jobDefinition=arn)
            except _AwsError as e:
                log.warning("fiber: cannot deregister job definition %s: %s", arn, e)
        if name is not None:
            try:
                self._call(self.client("ssm"), "delete_parameter", Name=name)
            except _AwsError as e:
                if e.code != "ParameterNotFound":
                    log.warning("fiber: cannot delete SSM parameter %s holding the key of run %s: %s "
                                "(`fiber clean --backend aws-batch --run %s` removes it)", name,
                                self.run_id, e, self.run_id)

    def job_definition(self, image: str, vcpus: int, memory: int, gpus: int,
                       volumes: Mapping[str, str] | None = None, key_parameter: str | None = None) -> str:
        """The ARN of a job definition for these resources: found or registered, then cached.

        With ``key_parameter``, the job's ``FIBER_AUTHKEY`` comes from that SSM parameter
        (``secrets``, injected by the execution role)."""
        props: dict[str, Any] = {
            "image": image,
            "resourceRequirements": self._resources(vcpus, memory, gpus),
            # An init process as PID 1 forwards TerminateJob's SIGTERM to the worker.
            "linuxParameters": {"initProcessEnabled": True},
        }
        if self.settings["job_role"]:
            props["jobRoleArn"] = self.settings["job_role"]
        if key_parameter:
            props["secrets"] = [{"name": ENV_AUTHKEY, "valueFrom": key_parameter}]
            props["executionRoleArn"] = self.settings["execution_role"]
        if self.settings["log_group"] != DEFAULT_LOG_GROUP:
            props["logConfiguration"] = {"logDriver": "awslogs", "options": {
                "awslogs-group": self.settings["log_group"], "awslogs-region": self.region,
                "awslogs-stream-prefix": "fiber"}}
        if volumes:
            props["volumes"], props["mountPoints"] = [], []
            for i, (source, target) in enumerate(sorted(volumes.items())):
                if not source.startswith("/"):
                    raise BackendError(
                        f"volume {source!r}: AWS Batch mounts host paths only; use an absolute path "
                        "on the container instance (or EFS in your own job definition)"
                    )
                props["volumes"].append({"name": f"v{i}", "host": {"sourcePath": source}})
                props["mountPoints"].append({"sourceVolume": f"v{i}", "containerPath": target,
                                             "readOnly": False})
        digest = hashlib.sha256(json.dumps(props, sort_keys=True).encode()).hexdigest()[:16]
        name = f"fiber-{digest}"
        with self._jobdef_lock:
            arn = self._jobdefs.get(name)
            if arn is not None:
                return arn
            try:
                found = self._call(self.batch, "describe_job_definitions",
                                   jobDefinitionName=name, status="ACTIVE")["jobDefinitions"]
                if found:
                    arn = max(found, key=lambda d: d["revision"])["jobDefinitionArn"]
                else:
                    arn = self._call(self.batch, "register_job_definition", jobDefinitionName=name,
                                     type="container", containerProperties=props,
                                     tags={"fiber": "job-definition"})["jobDefinitionArn"]
            except _AwsError as e:
                raise self._error(e, f"cannot register a job definition for image {image} on "
                                  f"{self._where()}", "check the credentials' batch:DescribeJobDefinitions "
                                  "and batch:RegisterJobDefinition permissions") from None
            self._jobdefs[name] = arn
            if key_parameter:
                self._secret_jobdefs.append(arn)
            return arn

    @staticmethod
    def _resources(vcpus: int, memory: int, gpus: int) -> list[dict[str, str]]:
        out = [{"type": "VCPU", "value": str(vcpus)}, {"type": "MEMORY", "value": str(memory)}]
        if gpus:
            out.append({"type": "GPU", "value": str(gpus)})
        return out

    def _job_name(self, name: str) -> str:
        with self._lock:
            self._count += 1
            n = self._count
        run = re.sub(r"[^A-Za-z0-9_-]", "", self.run_id) or "run"
        safe = re.sub(r"[^A-Za-z0-9_-]", "-", name)
        return f"fiber-{run}-{n}-{safe}"[:128]

    # -- the contract ------------------------------------------------------------------

    def create_job(self, spec: JobSpec) -> Job:
        return self._submit([spec])[0]

    def create_jobs(self, specs: Sequence[JobSpec]) -> list[Job]:
        """Start several jobs: identical specs as one array job (one ``SubmitJob`` for all of them).

        Each child of the array job (``PARENT:INDEX``) is a :class:`Job`, watched, stopped and
        explained like any other; its command tells it apart by ``AWS_BATCH_JOB_ARRAY_INDEX``.
        """
        if 2 <= len(specs) <= _MAX_ARRAY:
            if all(s == specs[0] for s in specs):
                return self._submit(specs)
            common = _group_spec(specs)
            if common is not None:
                return self._submit(specs, common)
        return super().create_jobs(specs)

    def _submit(self, specs: Sequence[JobSpec], common: JobSpec | None = None) -> list[Job]:
        """Submit ``specs`` (one, or several as an array job whose children all run
        ``common``, by default the first); return their jobs."""
        spec = common or specs[0]
        queue, gpus = self.queue_for(spec)
        image = spec.image or self.settings["image"]
        if not image:
            raise BackendError(
                f"no container image for {spec.name}: set [aws] image (FIBER_AWS_IMAGE) or the "
                "global image setting (FIBER_IMAGE) to an image with python3 and fiber-core"
            )
        vcpus = max(1, math.ceil(spec.cpu)) if spec.cpu else DEFAULT_VCPUS
        memory = spec.memory or DEFAULT_MEMORY
        env = {**self.extra_env, **spec.env}
        key_parameter = None
        if self.settings["key_from"] == "ssm" and ENV_AUTHKEY in env:
            key_parameter = self.key_parameter(env.pop(ENV_AUTHKEY))
        jobdef = self.job_definition(image, vcpus, memory, gpus, spec.volumes, key_parameter)
        command = list(spec.command)
        if spec.cwd:
            command = ["/bin/sh", "-c", 'cd "$0" && exec "$@"', spec.cwd, *command]
        tags = {_sanitise_tag(k, 128): _sanitise_tag(v, 256) for k, v in spec.labels.items()}
        tags.setdefault("fiber.run", _sanitise_tag(self.run_id, 256))
        job_name = self._job_name(spec.name)
        try:
            resp = self._call(
                self.batch, "submit_job", jobName=job_name, jobQueue=queue, jobDefinition=jobdef,
                containerOverrides={
                    "command": command,
                    "environment": [{"name": k, "value": v} for k, v in env.items()],
                    "resourceRequirements": self._resources(vcpus, memory, gpus),
                },
                tags=tags, **({"arrayProperties": {"size": len(specs)}} if len(specs) > 1 else {}),
            )
        except _AwsError as e:
            hint = (f"check that job queue {queue!r} exists in {self.region} and is ENABLED "
                    "([aws] queue / gpu_queues)") if e.code in ("ClientException", "") else \
                "check the credentials' batch:SubmitJob permission and the endpoint"
            raise self._error(e, f"AWS Batch did not accept {spec.name} on queue {queue!r}", hint) from None
        ids = [resp["jobId"]] if len(specs) == 1 else [f"{resp['jobId']}:{i}" for i in range(len(specs))]
        jobs = [Job(id=i, spec=s, handle=BatchJob(job_name=job_name, queue=queue, memory=memory))
                for i, s in zip(ids, specs)]
        with self._lock:
            self._pending.update((job.id, job) for job in jobs)
        self._ensure_poller()
        return jobs

    def terminate_job(self, job: Job) -> None:
        self._terminate(job, f"fiber: terminated by its parent (run {self.run_id})")

    def _terminate(self, job: Job, reason: str) -> None:
        handle: BatchJob = job.handle
        with self._lock:
            if job.state.done() or handle.stop_reason is not None:
                return
            handle.stop_reason = reason
        try:
            self._call(self.batch, "terminate_job", jobId=job.id, reason=reason)
        except _AwsError as e:
            with self._lock:
                handle.stop_reason = None
            raise self._error(e, f"cannot terminate AWS Batch job {job.id} on {self._where()}",
                              "check the credentials' batch:TerminateJob permission") from None
        with self._lock:
            if self._poller is not None:
                self._poller.wake()

    def get_job_logs(self, job: Job) -> str:
        """The job's CloudWatch Logs, then a line saying why it failed (when Batch or fiber know).

        Batch keeps a job's output in CloudWatch Logs, read here when asked (copying it into
        ``job.state.log`` would cost a GetLogEvents call for every job that ends). The
        explanation comes last, so that it survives when only the tail is shown.
        """
        handle: BatchJob = job.handle
        if handle.log_stream is None and job.state.done():
            try:  # the poller may have finished the job before Batch named its stream
                for d in self._call(self.batch, "describe_jobs", jobs=[job.id])["jobs"]:
                    handle.log_stream = _log_stream(d)
            except _AwsError:
                pass
        lines = []
        if handle.log_stream:
            try:
                lines += self._log_lines(handle.log_stream)
            except _AwsError as e:
                lines.append(f"fiber-aws: cannot read the job's logs ({self.settings['log_group']}/"
                             f"{handle.log_stream}): {e}")
        explanation = self.explain(job)
        if explanation:
            lines.append(explanation)
        return "\n".join(lines) + ("\n" if lines else "")

    def _log_lines(self, stream: str, limit: int = 100_000) -> list[str]:
        lines: list[str] = []
        kwargs: dict[str, Any] = {"logGroupName": self.settings["log_group"], "logStreamName": stream,
                                  "startFromHead": True}
        while len(lines) < limit:
            resp = self._call(self.client("logs"), "get_log_events", **kwargs)
            lines += [e["message"].rstrip("\n") for e in resp.get("events", [])]
            token = resp.get("nextForwardToken")
            if not resp.get("events") or not token or token == kwargs.get("nextToken"):
                break
            kwargs["nextToken"] = token
        return lines

    def explain(self, job: Job) -> str:
        """A line saying why the job failed, as far as Batch and fiber know; ``""`` if it did not."""
        handle: BatchJob = job.handle
        if handle.note:
            return f"fiber-aws: {handle.note}"
        if not job.state.done() or handle.status != "FAILED":
            return ""
        where = f"AWS Batch job {job.id} ({handle.job_name}, queue {handle.queue})"
        if job.state.reason is EndReason.STOPPED:
            return f"fiber-aws: {where} was terminated by fiber: {job.state.detail}"
        if job.state.detail:
            return f"fiber-aws: {where} FAILED: {job.state.detail}"
        if job.state.reason is EndReason.NEVER_STARTED:
            return (f"fiber-aws: {where} FAILED before its container ran, and Batch gave no reason: "
                    "check that the image exists where the compute environment pulls from and "
                    "contains the job's command (python3)")
        return ""

    def get_listen_addr(self) -> str:
        """This machine's address in the VPC of the jobs' compute environments.

        Batch jobs run on instances in the subnets of their queues' compute environments;
        they must be able to open a TCP connection to this process. (Fiber asks only when
        ``listen_host`` is not set.)
        """
        networks = self.job_networks()
        local = _local_ipv4_addresses()
        for net in networks:
            for addr in local:
                if addr in net:
                    return str(addr)
        shown = ", ".join(map(str, networks)) or "unknown: no subnets found in the queues' compute environments"
        raise BackendError(
            f"this machine has no address in the VPC where the AWS Batch jobs run ({shown}); the "
            "jobs connect back to this process, so run it inside that VPC (on EC2, or as a Batch "
            "job itself), or set listen_host (FIBER_LISTEN_HOST) to an address the jobs can reach "
            "and allow its listen_port in the jobs' security group"
        )

    def job_networks(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        """The CIDR blocks of the VPCs where the configured queues run their jobs."""
        if self._networks is not None:
            return self._networks
        queues = [q for q in (self.settings["queue"], *self.gpu_queues.values()) if q]
        networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        try:
            subnets: list[str] = []
            if queues:
                for ce in self._environments(queues):
                    subnets += (ce.get("computeResources") or {}).get("subnets", [])
            if subnets:
                vpc_ids = {s["VpcId"] for s in self._call(self.client("ec2"), "describe_subnets",
                                                          SubnetIds=sorted(set(subnets)))["Subnets"]}
                for vpc in self._call(self.client("ec2"), "describe_vpcs", VpcIds=sorted(vpc_ids))["Vpcs"]:
                    blocks = [a["CidrBlock"] for a in vpc.get("CidrBlockAssociationSet", [])
                              if a.get("CidrBlockState", {}).get("State", "associated") == "associated"]
                    for block in blocks or [vpc["CidrBlock"]]:
                        networks.append(ipaddress.ip_network(block, strict=False))
        except _AwsError as e:
            raise self._error(
                e, f"cannot find the VPC where the jobs of queue(s) {', '.join(queues)} run", "set "
                "listen_host (FIBER_LISTEN_HOST) to this machine's address that the jobs can reach, "
                "or allow batch:DescribeJobQueues, batch:DescribeComputeEnvironments, "
                "ec2:DescribeSubnets and ec2:DescribeVpcs") from None
        self._networks = networks
        return networks

    def cleanup(self) -> None:
        """Terminate every unfinished job of this run (at parent exit); safe to call twice.

        Batch reports the end of a terminated job a moment later, so the poller runs on
        after cleanup until it has recorded those ends, then stops.
        """
        self.take_jobs()  # each tracked job is pending here, or finished
        with self._lock:
            pending = [j for j in self._pending.values() if j.handle.stop_reason is None]
        reason = f"fiber: the parent process exited (run {self.run_id})"

        def stop(job: Job) -> None:
            job.state.stop_requested = True
            try:
                self._terminate(job, reason)
            except BackendError as e:
                log.warning("fiber: %s", e)

        if pending:
            try:
                with ThreadPoolExecutor(max_workers=min(8, len(pending))) as pool:
                    list(pool.map(stop, pending))
            except RuntimeError:  # at interpreter exit no new thread may start: one by one
                for job in pending:
                    stop(job)
        self._drop_key()  # the terminated jobs have read it long ago, or will never run
        super().cleanup()
        try:
            self._ensure_poller()
        except RuntimeError:
            pass  # at interpreter exit nobody waits for those ends

    @classmethod
    def clean(cls, settings: Mapping[str, Any], run_id: str | None = None) -> list[str]:
        """Terminate the unfinished jobs of ``run_id`` (or of every fiber run) in the configured queues."""
        backend = cls(settings, run_id or "")
        prefix = f"fiber-{run_id}-" if run_id else "fiber-"
        removed = []
        for queue in {q for q in (backend.settings["queue"], *backend.gpu_queues.values()) if q}:
            try:
                for summary in backend._list_jobs(queue, prefix):
                    if summary.get("status") in _FINAL:
                        continue
                    backend._call(backend.batch, "terminate_job", jobId=summary["jobId"], reason=CLEAN_REASON)
                    removed.append(f"AWS Batch job {summary['jobId']} ({summary['jobName']}, queue {queue})")
            except _AwsError as e:
                raise backend._error(e, f"cannot list or terminate the jobs in queue {queue!r} on "
                                     f"{backend._where()}", "check the credentials' batch:ListJobs and "
                                     "batch:TerminateJob permissions") from None
        removed += backend._clean_keys(run_id)
        return removed

    def _clean_keys(self, run_id: str | None) -> list[str]:
        """Delete the SSM parameters holding the keys of ``run_id`` (or of every fiber run),
        found by name (DescribeParameters: their values are not read)."""
        run = re.sub(r"[^A-Za-z0-9_.-]", "-", run_id) if run_id else ""
        path = f"/fiber/{run}/" if run else "/fiber/"
        ssm, removed, token = self.client("ssm"), [], None
        try:
            while True:
                page = self._call(ssm, "describe_parameters", ParameterFilters=[
                    {"Key": "Path", "Option": "Recursive", "Values": [path.rstrip("/")]}],
                    **({"NextToken": token} if token else {}))
                for p in page.get("Parameters", []):
                    if p["Name"].startswith(path) and p["Name"].endswith("/authkey"):
                        self._call(ssm, "delete_parameter", Name=p["Name"])
                        removed.append(f"SSM parameter {p['Name']}")
                token = page.get("NextToken")
                if not token:
                    return removed
        except _AwsError as e:
            if self.settings["key_from"] == "ssm":
                log.warning("fiber: cannot list or delete the SSM parameters under %s: %s", path, e)
            return removed

    # -- the poller ----------------------------------------------------------------------

    def _ensure_poller(self) -> None:
        """Start the poller if a job is unfinished and none runs."""
        with self._lock:
            if self._pending and (self._poller is None or self._poller.stopped):
                self._poller = self.watch(self._poll, f"poller-{self.run_id}",
                                          self.settings["poll_interval"], _MAX_BACKOFF)

    def _poll(self) -> None:
        """One round: refresh every unfinished job; when none is left, the poller stops."""
        with self._lock:
            pending = list(self._pending.values())
            if not pending:
                if self._poller is not None:
                    self._poller.stop()
                    self._poller = None
                return
        try:
            self._refresh(pending)
        except _AwsError as e:
            if not e.throttled and str(e) not in self._errors_shown:
                self._errors_shown.add(str(e))
                log.warning("fiber: cannot read the status of AWS Batch jobs (retrying): %s", e)
            raise
        except Exception:
            log.exception("fiber: the AWS Batch poller failed (retrying)")
            raise

    def _refresh(self, pending: list[Job]) -> None:
        for i in range(0, len(pending), self.describe_batch):
            chunk = pending[i:i + self.describe_batch]
            described = {d["jobId"]: d for d in self._call(self.batch, "describe_jobs",
                                                           jobs=[job.id for job in chunk])["jobs"]}
            for job in chunk:
                handle: BatchJob = job.handle
                d = described.get(job.id)
                if d is not None:
                    handle.described, handle.missing = d, 0
                    handle.log_stream = _log_stream(d) or handle.log_stream
                    continue
                handle.missing += 1
                if handle.missing >= _LOST_AFTER and time.monotonic() - handle.submitted > _LOST_GRACE:
                    handle.note = (f"AWS Batch no longer knows job {job.id} ({handle.job_name}, "
                                   f"queue {handle.queue}): it was deleted or expired")
                    self._finish(job, 1, EndReason.HOST_LOST, handle.note)
        finished = [job for job in pending if job.handle.status in _FINAL and not job.state.done()]
        without_code = [job for job in finished if exit_status(job.handle.described) is None
                        and job.handle.described.get("startedAt") is not None]
        if without_code:
            self._fill_exit_status(without_code)
        for job in finished:
            self._end(job)
        self._check_queued(pending)

    def _end(self, job: Job) -> None:
        """Finish the state of a job that Batch reports SUCCEEDED or FAILED."""
        handle: BatchJob = job.handle
        failed = handle.status == "FAILED"
        reason, said = end_reason(handle.described, stop_reason=handle.stop_reason, memory=handle.memory,
                                  spot=failed and self._queue_is_spot(handle.queue))
        if self._finish(job, self._final_code(handle), reason, said) and failed and said and \
                reason is not EndReason.STOPPED:
            log.warning("fiber: %s", self.explain(job).removeprefix("fiber-aws: "))

    def _final_code(self, handle: BatchJob) -> int:
        status = exit_status(handle.described)
        if status is not None:
            code = exitcode_from_status(status)
            return status if code is None else code
        if handle.status == "SUCCEEDED":
            return 0
        if handle.stop_reason is not None:
            return -15  # terminated before its container ran
        return 1

    def _queue_is_spot(self, queue: str) -> bool:
        """Whether a compute environment of ``queue`` runs on Spot capacity (asked once per queue)."""
        with self._lock:
            known = self._spot.get(queue)
        if known is None:
            try:
                known = any((ce.get("computeResources") or {}).get("type") in _SPOT_ENVIRONMENTS
                            for ce in self._environments([queue]))
            except _AwsError as e:
                log.debug("fiber: cannot tell whether queue %s runs on Spot capacity: %s", queue, e)
                known = False
            with self._lock:
                self._spot[queue] = known
        return known

    def _fill_exit_status(self, jobs: list[Job]) -> None:
        # Some Batch implementations (moto) leave container.exitCode out of DescribeJobs; the job
        # summaries of ListJobs carry it too. One call per queue, only when needed.
        by_id: dict[str, BatchJob] = {job.id: job.handle for job in jobs}
        prefix = f"fiber-{re.sub(r'[^A-Za-z0-9_-]', '', self.run_id) or 'run'}-"
        for queue in {handle.queue for handle in by_id.values()}:
            for summary in self._list_jobs(queue, prefix):
                handle = by_id.get(summary["jobId"])
                status = (summary.get("container") or {}).get("exitCode")
                if handle is not None and status is not None:
                    handle.described.setdefault("container", {})["exitCode"] = int(status)

    def _list_jobs(self, queue: str, prefix: str) -> Iterator[dict[str, Any]]:
        kwargs: dict[str, Any] = {"jobQueue": queue,
                                  "filters": [{"name": "JOB_NAME", "values": [prefix + "*"]}]}
        while True:
            resp = self._call(self.batch, "list_jobs", **kwargs)
            yield from resp.get("jobSummaryList", [])
            if not resp.get("nextToken"):
                return
            kwargs["nextToken"] = resp["nextToken"]

    def _check_queued(self, pending: list[Job]) -> None:
        limit = self.settings["runnable_timeout"]
        if not limit:
            return
        now = time.monotonic()
        for job in pending:
            handle: BatchJob = job.handle
            if handle.status not in _QUEUED or job.state.done() or now - handle.submitted <= limit:
                continue
            reason = (f"fiber: no capacity within runnable_timeout={limit:g}s on queue "
                      f"{handle.queue} (run {self.run_id})")
            handle.note = (
                f"AWS Batch job {job.id} ({handle.job_name}) waited more than {limit:g}s in "
                f"{handle.status} on queue {handle.queue} without starting: its compute environments "
                "have no capacity for it (no instance type with its vCPUs, memory or GPUs, maxvCpus "
                "reached, or an EC2 quota). Check the queue's compute environments, or raise "
                f"[aws] runnable_timeout (FIBER_AWS_RUNNABLE_TIMEOUT; 0 waits forever)"
            )
            log.warning("fiber: %s", handle.note)
            try:
                self._terminate(job, reason)
            except BackendError as e:
                log.warning("fiber: %s", e)
            self._finish(job, 1, EndReason.NEVER_STARTED, handle.note)

    def _finish(self, job: Job, code: int, reason: EndReason, detail: str) -> bool:
        """Record the end of ``job`` (the first end wins) and stop polling it."""
        first = job.state.finish(code, reason, detail)
        with self._lock:
            self._pending.pop(job.id, None)
        return first


def _log_stream(described: Mapping[str, Any]) -> str | None:
    container, attempt = _container(described)
    return container.get("logStreamName") or attempt.get("logStreamName")
