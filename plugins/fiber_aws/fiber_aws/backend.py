"""The ``aws-batch`` backend: every Fiber job is an AWS Batch job.

:meth:`AwsBatchBackend.create_job` picks the job queue from the job's hardware (the CPU
queue, or the queue configured for its GPU type), finds or registers a job definition for
its image and resources, and submits the job with the worker command and environment.
One poller thread per backend keeps the status of every unfinished job of the run with
batched ``DescribeJobs`` calls.

boto3 takes a second to import and set up, so it is imported when a backend is created,
never when the plugin is loaded.
"""

from __future__ import annotations

import configparser
import hashlib
import ipaddress
import json
import logging
import math
import os
import re
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fiber_core.base.errors import BackendError, ConfigError
from fiber_core.base.options import Option, parse_pairs
from fiber_core.contract.backend import Backend, Job, JobSpec, exitcode_from_status
from fiber_core.runtime.config import CONFIG_FILE, config

log = logging.getLogger("fiber")

SECTION = "aws"
"""Configuration section: ``[aws]`` in ``.fiberconfig``, ``FIBER_AWS_*``, ``init(aws_...)``."""

DEFAULT_LOG_GROUP = "/aws/batch/job"
DEFAULT_VCPUS = 1
DEFAULT_MEMORY = 2048  # MiB

OPTIONS: tuple[Option, ...] = (
    Option("region", str, None, "AWS region of the job queues (default: the boto3 chain, e.g. AWS_REGION)"),
    Option("queue", str, None, "job queue for CPU jobs"),
    Option("gpu_queues", list, [], "job queue per GPU type: a10g:QUEUE,v100:QUEUE"),
    Option("image", str, None, "container image of the jobs (default: the global image setting)"),
    Option("job_role", str, None, "ARN of the IAM role the jobs run as (their own AWS credentials)"),
    Option("log_group", str, DEFAULT_LOG_GROUP, "CloudWatch Logs group the jobs log to"),
    Option("extra_env", list, [], "KEY=VALUE pairs set in every job"),
    Option("endpoint_url", str, None, "endpoint for Batch, CloudWatch Logs and EC2 (an emulator in tests)"),
    Option("poll_interval", float, 1.0, "seconds between two DescribeJobs rounds of the poller"),
    Option("runnable_timeout", float, 1800.0,
           "seconds a job may wait for capacity (SUBMITTED/PENDING/RUNNABLE) before it is failed; 0: forever"),
    Option("api_timeout", float, 30.0, "seconds one AWS API call may take before it is an error"),
)

_QUEUED = ("SUBMITTED", "PENDING", "RUNNABLE")
_FINAL = ("SUCCEEDED", "FAILED")
_MAX_BACKOFF = 30.0
_LOST_AFTER = 3  # DescribeJobs rounds without the job before it counts as lost...
_LOST_GRACE = 60.0  # ...and seconds after submission (new jobs may not be visible at once)
_THROTTLED = {"ThrottlingException", "Throttling", "TooManyRequestsException",
              "RequestLimitExceeded", "SlowDown"}
_CREDENTIAL_WORDS = re.compile(r"secret|access_?key|session_?token|password|credential", re.I)
_AWS_CREDENTIAL_ENV = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}
_ACCESS_KEY_ID = re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b")
_TAG_CHARS = re.compile(r"[^\w .:/=+\-@]")


class _AwsError(Exception):
    """A failed AWS call, stripped of botocore's types (so this module need not import them)."""

    def __init__(self, operation: str, code: str, message: str) -> None:
        super().__init__(f"{operation}: {code}: {message}" if code else f"{operation}: {message}")
        self.code = code
        self.message = message
        self.throttled = code in _THROTTLED


@dataclass(eq=False)
class BatchJobState:
    """What the poller knows of one Batch job; the ``handle`` of its :class:`Job`."""

    job_id: str
    job_name: str
    queue: str
    job_definition: str
    submitted: float = field(default_factory=time.monotonic)
    status: str = "SUBMITTED"
    status_reason: str | None = None
    container_reason: str | None = None
    exit_status: int | None = None
    """The container's exit status as Batch reports it (``128 + N`` after signal ``N``)."""
    log_stream: str | None = None
    started: bool = False
    """Batch reported a start time: the container was started."""
    stop_reason: str | None = None
    """The reason fiber gave when it terminated the job."""
    note: str | None = None
    """Fiber's own explanation of a failure (no capacity, job lost)."""
    code: int | None = None
    """The final exit code in ``multiprocessing``'s terms, once known."""
    missing: int = 0
    done: threading.Event = field(default_factory=threading.Event)


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


def _refuse_credentials(explicit: Mapping[str, Any], settings: Mapping[str, Any]) -> None:
    """Fail if anything that looks like an AWS credential reached fiber's configuration."""
    advice = ("AWS credentials are never read from fiber's configuration: remove it and use the "
              "standard boto3 chain (AWS_PROFILE, ~/.aws/credentials, AWS_ACCESS_KEY_ID and "
              "AWS_SECRET_ACCESS_KEY in the environment, an instance or task role)")
    found: list[str] = []
    prefixes = ("FIBER_AWS_", "FIBER_AWS-BATCH_")
    found += [f"environment variable {k}" for k in os.environ
              if k.upper().startswith(prefixes) and _CREDENTIAL_WORDS.search(k.split("_", 2)[-1])]
    path = os.path.abspath(CONFIG_FILE)
    if os.path.exists(path):
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(path, encoding="utf-8")
        except configparser.Error:
            pass  # fiber's own config reader reports a malformed file
        for section in ("aws", "aws-batch"):
            if parser.has_section(section):
                found += [f"{k} in [{section}] of {path}" for k in parser.options(section)
                          if _CREDENTIAL_WORDS.search(k)]
    found += [f"init({k}=...)" for k in config.snapshot()
              if k.lower().startswith(("aws_", "aws-batch_")) and _CREDENTIAL_WORDS.search(k.split("_", 1)[1])]
    found += [f"setting {k!r}" for k in explicit if _CREDENTIAL_WORDS.search(k)]
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


class AwsBatchBackend(Backend):
    """Runs each job as an AWS Batch job; a GPU job goes to the queue of its GPU type.

    Settings come from the ``[aws]`` section (``FIBER_AWS_*``): the section is ``aws``,
    not the backend's name, because a dash cannot appear in an environment variable
    set from a shell. Job definitions are registered on demand, one per distinct image
    and resources, and reused across runs. One poller thread per backend refreshes
    every unfinished job with ``DescribeJobs`` calls of up to 100 ids and backs off when
    throttled; :meth:`poll_job` answers from its cache. AWS Batch has one way to stop a
    job (``TerminateJob``: ``SIGTERM``, then ``SIGKILL`` after the ECS stop timeout), so
    :meth:`kill_job` is :meth:`terminate_job`.
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
        explicit = dict(settings or {})
        config.register_backend_options(SECTION, OPTIONS)  # when built before the registry loads
        resolved = dict(config.backend_settings(SECTION))
        resolved.update(explicit)
        for o in OPTIONS:  # explicit settings may be strings, as from a file
            resolved[o.name] = o.parse(resolved[o.name], f"{SECTION}_{o.name}", "settings")
        super().__init__(resolved, run_id, rundir)
        _refuse_credentials(explicit, resolved)
        self.gpu_queues = parse_gpu_queues(resolved["gpu_queues"])
        self.extra_env = parse_pairs(resolved["extra_env"], f"extra_env in [{SECTION}]")
        self._states: dict[str, BatchJobState] = {}
        self._lock = threading.Lock()
        self._jobdef_lock = threading.Lock()
        self._jobdefs: dict[str, str] = {}
        self._count = 0
        self._poller: threading.Thread | None = None
        self._wake = threading.Event()
        self._networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] | None = None
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
                "(FIBER_AWS_REGION), or AWS_REGION / a profile's region for boto3"
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
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(client, operation)(**kwargs)
        except ClientError as e:
            err = e.response.get("Error", {})
            raise _AwsError(operation, err.get("Code", ""), err.get("Message", str(e))) from e
        except BotoCoreError as e:
            raise _AwsError(operation, type(e).__name__, str(e)) from e

    def _where(self) -> str:
        endpoint = self.settings["endpoint_url"]
        return f"AWS Batch in {self.region}" + (f" at {endpoint}" if endpoint else "")

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

    def job_definition(self, image: str, vcpus: int, memory: int, gpus: int,
                       volumes: Mapping[str, str] | None = None) -> str:
        """The ARN of a job definition for these resources: found or registered, then cached."""
        props: dict[str, Any] = {
            "image": image,
            "resourceRequirements": self._resources(vcpus, memory, gpus),
            # An init process as PID 1 forwards TerminateJob's SIGTERM to the worker.
            "linuxParameters": {"initProcessEnabled": True},
        }
        if self.settings["job_role"]:
            props["jobRoleArn"] = self.settings["job_role"]
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
                raise BackendError(
                    f"cannot register a job definition for image {image} on {self._where()}: "
                    f"{e}. Check the credentials' batch:RegisterJobDefinition permission"
                ) from e
            self._jobdefs[name] = arn
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
        queue, gpus = self.queue_for(spec)
        image = spec.image or self.settings["image"]
        if not image:
            raise BackendError(
                f"no container image for {spec.name}: set [aws] image (FIBER_AWS_IMAGE) or the "
                "global image setting (FIBER_IMAGE) to an image with python3 and fiber-core"
            )
        vcpus = max(1, math.ceil(spec.cpu)) if spec.cpu else DEFAULT_VCPUS
        memory = spec.memory or DEFAULT_MEMORY
        jobdef = self.job_definition(image, vcpus, memory, gpus, spec.volumes)
        command = list(spec.command)
        if spec.cwd:
            command = ["/bin/sh", "-c", 'cd "$0" && exec "$@"', spec.cwd, *command]
        env = {**self.extra_env, **spec.env}
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
                tags=tags,
            )
        except _AwsError as e:
            hint = (f"check that job queue {queue!r} exists in {self.region} and is ENABLED "
                    "([aws] queue / gpu_queues)") if e.code in ("ClientException", "") else \
                "check the credentials' batch:SubmitJob permission and the endpoint"
            raise BackendError(f"AWS Batch did not accept {spec.name} on queue {queue!r}: {e}; {hint}") from e
        state = BatchJobState(job_id=resp["jobId"], job_name=job_name, queue=queue,
                              job_definition=jobdef)
        with self._lock:
            self._states[state.job_id] = state
        self._ensure_poller()
        return Job(id=state.job_id, spec=spec, handle=state)

    def poll_job(self, job: Job) -> int | None:
        state: BatchJobState = job.handle
        if state.done.is_set():
            return state.code
        self._ensure_poller()
        return None

    def wait_for_job(self, job: Job, timeout: float | None = None) -> int | None:
        state: BatchJobState = job.handle
        if not state.done.is_set():
            self._ensure_poller()
        if state.done.wait(timeout):
            job.state.finish(state.code)
            return state.code
        return None

    def terminate_job(self, job: Job) -> None:
        self._terminate(job.handle, f"fiber: terminated by its parent (run {self.run_id})")

    def _terminate(self, state: BatchJobState, reason: str) -> None:
        with self._lock:
            if state.done.is_set() or state.stop_reason is not None:
                return
            state.stop_reason = reason
        try:
            self._call(self.batch, "terminate_job", jobId=state.job_id, reason=reason)
        except _AwsError as e:
            with self._lock:
                state.stop_reason = None
            raise BackendError(f"cannot terminate AWS Batch job {state.job_id} on {self._where()}: {e}") from e
        self._wake.set()

    def get_job_logs(self, job: Job) -> str:
        """The job's CloudWatch Logs, then a line saying why it failed (when Batch or fiber know).

        The explanation comes last, so that it survives when only the tail is shown.
        """
        state: BatchJobState = job.handle
        if state.log_stream is None and state.done.is_set():
            try:  # the poller may have finished the job before Batch named its stream
                self._update(self._call(self.batch, "describe_jobs", jobs=[state.job_id])["jobs"])
            except _AwsError:
                pass
        lines = []
        if state.log_stream:
            try:
                lines += self._log_lines(state.log_stream)
            except _AwsError as e:
                lines.append(f"fiber-aws: cannot read the job's logs ({self.settings['log_group']}/"
                             f"{state.log_stream}): {e}")
        explanation = self.explain(state)
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

    def explain(self, state: BatchJobState) -> str:
        """A line saying why the job failed, as far as Batch and fiber know; ``""`` if it did not."""
        if state.note:
            return f"fiber-aws: {state.note}"
        if state.status != "FAILED":
            return ""
        where = f"AWS Batch job {state.job_id} ({state.job_name}, queue {state.queue})"
        if state.stop_reason is not None and state.status_reason == state.stop_reason:
            return f"fiber-aws: {where} was terminated by fiber: {state.stop_reason}"
        reasons = "; ".join(r for r in (state.status_reason, state.container_reason) if r)
        if reasons:
            return f"fiber-aws: {where} FAILED: {reasons}"
        if state.exit_status is None:
            return (f"fiber-aws: {where} FAILED before its container ran, and Batch gave no reason: "
                    "check that the image exists where the compute environment pulls from and "
                    "contains the job's command (python3)")
        return ""

    def get_listen_addr(self) -> str:
        """This machine's address in the VPC of the jobs' compute environments, or ``listen_host``.

        Batch jobs run on instances in the subnets of their queues' compute environments;
        they must be able to open a TCP connection to this process.
        """
        configured = config.get("listen_host")
        if configured:
            return configured
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
            ces: list[str] = []
            if queues:
                for q in self._call(self.batch, "describe_job_queues", jobQueues=queues)["jobQueues"]:
                    ces += [o["computeEnvironment"] for o in q.get("computeEnvironmentOrder", [])]
            subnets: list[str] = []
            if ces:
                described = self._call(self.batch, "describe_compute_environments",
                                       computeEnvironments=sorted(set(ces)))["computeEnvironments"]
                for ce in described:
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
            raise BackendError(
                f"cannot find the VPC where the jobs of queue(s) {', '.join(queues)} run ({e}); set "
                "listen_host (FIBER_LISTEN_HOST) to this machine's address that the jobs can reach, "
                "or allow batch:DescribeJobQueues, batch:DescribeComputeEnvironments, "
                "ec2:DescribeSubnets and ec2:DescribeVpcs"
            ) from e
        self._networks = networks
        return networks

    def cleanup(self) -> None:
        """Terminate every unfinished job of this run (at parent exit); safe to call twice."""
        with self._jobs_lock:
            self._jobs = []
        with self._lock:
            pending = [s for s in self._states.values()
                       if not s.done.is_set() and s.stop_reason is None]
        if not pending:
            return
        reason = f"fiber: the parent process exited (run {self.run_id})"

        def stop(state: BatchJobState) -> None:
            try:
                self._terminate(state, reason)
            except BackendError as e:
                log.warning("fiber: %s", e)

        try:
            with ThreadPoolExecutor(max_workers=min(8, len(pending))) as pool:
                list(pool.map(stop, pending))
        except RuntimeError:  # at interpreter exit no new thread may start: one by one
            for state in pending:
                if state.stop_reason is None:
                    stop(state)

    @classmethod
    def clean(cls, settings: Mapping[str, Any], run_id: str | None = None) -> list[str]:
        """Terminate the unfinished jobs of ``run_id`` (or of every fiber run) in the configured queues."""
        backend = cls(settings, run_id or "")
        prefix = f"fiber-{run_id}-" if run_id else "fiber-"
        removed = []
        for queue in {q for q in (backend.settings["queue"], *backend.gpu_queues.values()) if q}:
            for summary in backend._list_jobs(queue, prefix):
                if summary.get("status") in _FINAL:
                    continue
                backend._call(backend.batch, "terminate_job", jobId=summary["jobId"],
                              reason="fiber clean: left behind by a crashed run")
                removed.append(f"AWS Batch job {summary['jobId']} ({summary['jobName']}, queue {queue})")
        return removed

    # -- the poller ----------------------------------------------------------------------

    def _ensure_poller(self) -> None:
        with self._lock:
            if self._poller is None:
                self._poller = threading.Thread(target=self._poll_loop, daemon=True,
                                                name=f"fiber-aws-poller-{self.run_id}")
                self._poller.start()

    def _poll_loop(self) -> None:
        delay = self.settings["poll_interval"]
        errors_shown: set[str] = set()
        while True:
            with self._lock:
                pending = [s for s in self._states.values() if not s.done.is_set()]
                if not pending:
                    self._poller = None
                    return
            try:
                self._refresh(pending)
                delay = self.settings["poll_interval"]
            except _AwsError as e:
                delay = min(max(delay, 0.1) * 2, _MAX_BACKOFF)
                if not e.throttled and str(e) not in errors_shown:
                    errors_shown.add(str(e))
                    log.warning("fiber: cannot read the status of AWS Batch jobs (retrying): %s", e)
            except Exception:
                delay = min(max(delay, 0.1) * 2, _MAX_BACKOFF)
                log.exception("fiber: the AWS Batch poller failed (retrying)")
            self._wake.wait(delay)
            self._wake.clear()

    def _refresh(self, pending: list[BatchJobState]) -> None:
        for i in range(0, len(pending), self.describe_batch):
            chunk = pending[i:i + self.describe_batch]
            seen = self._update(self._call(self.batch, "describe_jobs",
                                           jobs=[s.job_id for s in chunk])["jobs"])
            for state in chunk:
                if state.job_id in seen:
                    state.missing = 0
                    continue
                state.missing += 1
                if state.missing >= _LOST_AFTER and time.monotonic() - state.submitted > _LOST_GRACE:
                    state.note = (f"AWS Batch no longer knows job {state.job_id} ({state.job_name}, "
                                  f"queue {state.queue}): it was deleted or expired")
                    self._finish(state, 1)
        finished = [s for s in pending if s.status in _FINAL and not s.done.is_set()]
        without_code = [s for s in finished if s.exit_status is None and s.started]
        if without_code:
            self._fill_exit_status(without_code)
        for state in finished:
            self._finish(state, self._final_code(state))
        self._check_queued(pending)

    def _update(self, described: list[dict[str, Any]]) -> set[str]:
        seen = set()
        for d in described:
            with self._lock:
                state = self._states.get(d["jobId"])
            if state is None:
                continue
            seen.add(state.job_id)
            container = d.get("container") or {}
            attempt = (d.get("attempts") or [{}])[-1].get("container") or {}
            state.status = d["status"]
            state.status_reason = d.get("statusReason") or state.status_reason
            state.container_reason = container.get("reason") or attempt.get("reason") or state.container_reason
            status = container.get("exitCode", attempt.get("exitCode"))
            if status is not None:
                state.exit_status = int(status)
            state.log_stream = container.get("logStreamName") or attempt.get("logStreamName") or state.log_stream
            state.started = state.started or d.get("startedAt") is not None
            if state.status == "FAILED" and state.stop_reason is None and not state.done.is_set() and (
                    state.status_reason or state.container_reason):
                log.warning("fiber: %s", self.explain(state).removeprefix("fiber-aws: "))
        return seen

    def _fill_exit_status(self, states: list[BatchJobState]) -> None:
        # Some Batch implementations (moto) leave container.exitCode out of DescribeJobs; the job
        # summaries of ListJobs carry it too. One call per queue, only when needed.
        by_id = {s.job_id: s for s in states}
        prefix = f"fiber-{re.sub(r'[^A-Za-z0-9_-]', '', self.run_id) or 'run'}-"
        for queue in {s.queue for s in states}:
            for summary in self._list_jobs(queue, prefix):
                state = by_id.get(summary["jobId"])
                status = (summary.get("container") or {}).get("exitCode")
                if state is not None and status is not None:
                    state.exit_status = int(status)

    def _list_jobs(self, queue: str, prefix: str) -> Iterator[dict[str, Any]]:
        kwargs: dict[str, Any] = {"jobQueue": queue,
                                  "filters": [{"name": "JOB_NAME", "values": [prefix + "*"]}]}
        while True:
            resp = self._call(self.batch, "list_jobs", **kwargs)
            yield from resp.get("jobSummaryList", [])
            if not resp.get("nextToken"):
                return
            kwargs["nextToken"] = resp["nextToken"]

    def _final_code(self, state: BatchJobState) -> int:
        if state.exit_status is not None:
            return exitcode_from_status(state.exit_status)  # type: ignore[return-value]
        if state.status == "SUCCEEDED":
            return 0
        if state.stop_reason is not None:
            return -15  # terminated before its container ran
        return 1

    def _check_queued(self, pending: list[BatchJobState]) -> None:
        limit = self.settings["runnable_timeout"]
        if not limit:
            return
        now = time.monotonic()
        for state in pending:
            if state.status not in _QUEUED or state.done.is_set() or now - state.submitted <= limit:
                continue
            reason = (f"fiber: no capacity within runnable_timeout={limit:g}s on queue "
                      f"{state.queue} (run {self.run_id})")
            state.note = (
                f"AWS Batch job {state.job_id} ({state.job_name}) waited more than {limit:g}s in "
                f"{state.status} on queue {state.queue} without starting: its compute environments "
                "have no capacity for it (no instance type with its vCPUs, memory or GPUs, maxvCpus "
                "reached, or an EC2 quota). Check the queue's compute environments, or raise "
                f"[aws] runnable_timeout (FIBER_AWS_RUNNABLE_TIMEOUT; 0 waits forever)"
            )
            log.warning("fiber: %s", state.note)
            try:
                self._terminate(state, reason)
            except BackendError as e:
                log.warning("fiber: %s", e)
            self._finish(state, 1)

    def _finish(self, state: BatchJobState, code: int) -> None:
        with self._lock:
            if state.done.is_set():
                return
            state.code = code
            state.done.set()

    # -- for tests and tools -------------------------------------------------------------

    def state(self, job: Job) -> BatchJobState:
        """What the poller knows of ``job`` (status, reasons, log stream)."""
        return job.handle
