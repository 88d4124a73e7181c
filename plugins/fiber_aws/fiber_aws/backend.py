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
import logging
import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from fiber_core.contract import (
    ENV_OPTIONS,
    FALLBACK_WAIT,
    Backend,
    BackendError,
    EndReason,
    Job,
    JobSpec,
    Option,
    remove_all,
)

from fiber_aws.api import AwsError, call, list_jobs, local_ipv4_addresses
from fiber_aws.parameters import RunParameters
from fiber_aws.poller import Poller
from fiber_aws.spec import (
    SECTION,
    capacity_queue,
    choice_spec,
    command,
    container_environment,
    group_spec,
    job_name,
    queue_for,
    queue_lists,
    refuse_credentials,
    resources,
    tags,
    volumes,
)
from fiber_aws.status import CLEAN_REASON, FINAL, BatchJob, explain, log_stream

log = logging.getLogger("fiber")

DEFAULT_LOG_GROUP = "/aws/batch/job"
DEFAULT_VCPUS = 1
DEFAULT_MEMORY = 2048  # MiB

OPTIONS: tuple[Option, ...] = (
    Option("region", str, None, "AWS region of the job queues (default: the boto3 chain, e.g. AWS_DEFAULT_REGION)"),
    Option("queue", str, None, "job queue for CPU jobs (several, comma-separated, for capacity kinds: the first is "
           "the default)"),
    Option("gpu_queues", list, [], "job queue per GPU type: a10g:QUEUE,v100:QUEUE; the type is matched "
           "case-insensitively against meta(gpu_type=...); a type listed again names another queue (the first is "
           "the default; capacity=spot/on-demand takes the first of that kind)"),
    Option("image", str, None, "container image of the jobs (default: the global image setting)"),
    Option("job_role", str, None, "ARN of the IAM role the jobs run as (their own AWS credentials)"),
    Option("log_group", str, DEFAULT_LOG_GROUP, "CloudWatch Logs group the jobs log to (another group is set in "
           "the job definition with the awslogs driver)"),
    *ENV_OPTIONS,
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
    FALLBACK_WAIT,
)

_MAX_ARRAY = 10_000  # children of one array job

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
    gpu_alternatives = True  # the queues of the alternatives in order, each after fallback_wait
    capacity_kinds = True  # the queues whose compute environments are of the kind asked
    describe_batch = 100
    """Job ids per DescribeJobs call (the API takes at most 100)."""

    def __init__(self, settings: Mapping[str, Any] | None = None, run_id: str = "",
                 rundir: str | None = None) -> None:
        super().__init__(settings, run_id, rundir)
        refuse_credentials(self.settings, {o.name for o in OPTIONS})
        self.queues = queue_lists(self.settings["queue"], self.settings["gpu_queues"])
        """Every queue of each GPU type (``None``: CPU jobs), in order; the first is the default."""
        self.gpu_queues = {t: qs[0] for t, qs in self.queues.items() if t is not None}
        self.job_env(JobSpec(command=[]))  # a bad extra_env entry fails here, at once
        self._lock = threading.Lock()
        self._moving = threading.RLock()  # held while a job moves to its next GPU alternative
        self._poller = Poller(self)
        self._jobdef_lock = threading.Lock()
        self._jobdefs: dict[str, str] = {}
        self._count = 0
        self._networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] | None = None
        self._secret_jobdefs: list[str] = []  # job definitions naming that parameter: deregistered at cleanup
        self._session, self._client_config = self._session_and_config()
        self._clients: dict[str, Any] = {}
        self.batch = self.client("batch")
        """The boto3 Batch client."""
        self.parameters = RunParameters(self.run_id, self.settings, lambda: self.client("ssm"),
                                        self._error, self._where)
        """The run's key and secret variables in SSM (:mod:`fiber_aws.parameters`)."""

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
        timeout = self.api_timeout
        return session, Config(connect_timeout=timeout, read_timeout=timeout, max_pool_connections=16,
                               retries={"mode": "standard", "max_attempts": 3})

    def client(self, service: str) -> Any:
        """The boto3 client for ``service`` ("batch", "logs", "ec2"), created on first use."""
        with self._lock:
            if service not in self._clients:
                self._clients[service] = self._session.client(
                    service, config=self._client_config, endpoint_url=self.settings["endpoint_url"])
            return self._clients[service]

    def _error(self, e: AwsError, failed: str, fix: str) -> BackendError:
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

    def environments(self, queues: list[str]) -> list[dict[str, Any]]:
        """The compute environments of the job queues ``queues``."""
        names: list[str] = []
        for q in call(self.batch, "describe_job_queues", jobQueues=queues)["jobQueues"]:
            names += [o["computeEnvironment"] for o in q.get("computeEnvironmentOrder", [])]
        if not names:
            return []
        return call(self.batch, "describe_compute_environments",
                          computeEnvironments=sorted(set(names)))["computeEnvironments"]

    # -- routing and job definitions ---------------------------------------------------

    def queue_for(self, spec: JobSpec) -> tuple[str, int]:
        """The job queue for ``spec`` and its GPU count; BackendError if none is configured. A
        job of one capacity kind goes to the first queue of its hardware with compute
        environments of that kind (asked of Batch once per queue)."""
        cpu = self.queues.get(None)
        queue, gpus = queue_for(spec, cpu[0] if cpu else None, self.gpu_queues)
        if spec.capacity is None:
            return queue, gpus
        key = None if not gpus else (spec.gpu_type or "").lower() or next(iter(self.gpu_queues))
        candidates = self.queues.get(key) or [queue]
        kinds = {q: "spot" if self._poller.queue_is_spot(q) else "on-demand" for q in candidates}
        what = f"{spec.name} ({f'{gpus} GPU(s) of type {spec.gpu_type}' if gpus else 'CPU'})"
        return capacity_queue(spec.capacity, candidates, kinds, what), gpus

    def all_queues(self) -> list[str]:
        """Every configured queue, once."""
        return list(dict.fromkeys(q for qs in self.queues.values() for q in qs))

    # -- the run's key and secret variables (parameters.py) ----------------------------

    def key_parameter(self, value: str) -> str:
        """The SSM parameter that holds the run's key ``value``, made on first use."""
        return self.parameters.key(value)

    def _drop_key(self) -> None:
        """Deregister the job definitions that name the run's parameters, then delete them."""
        with self._jobdef_lock:
            jobdefs, self._secret_jobdefs = self._secret_jobdefs, []
            for key in [k for k, arn in self._jobdefs.items() if arn in jobdefs]:
                del self._jobdefs[key]
        for arn in jobdefs:
            try:
                call(self.batch, "deregister_job_definition", jobDefinition=arn)
            except AwsError as e:
                log.warning("fiber: cannot deregister job definition %s: %s", arn, e)
        self.parameters.drop()

    def job_definition(self, image: str, vcpus: int, memory: int, gpus: int,
                       mounts: Mapping[str, str] | None = None, secrets: Sequence[Mapping[str, str]] = ()) -> str:
        """The ARN of a job definition for these resources: found or registered, then cached.

        ``secrets`` (from :func:`~fiber_aws.spec.container_environment`) are the variables that
        come from SSM parameters (the run's key, those marked secret), injected by the
        execution role."""
        props: dict[str, Any] = {
            "image": image,
            "resourceRequirements": resources(vcpus, memory, gpus),
            # An init process as PID 1 forwards TerminateJob's SIGTERM to the worker.
            "linuxParameters": {"initProcessEnabled": True},
        }
        if self.settings["job_role"]:
            props["jobRoleArn"] = self.settings["job_role"]
        if secrets:
            props["secrets"] = [dict(s) for s in secrets]
            props["executionRoleArn"] = self.settings["execution_role"]
        if self.settings["log_group"] != DEFAULT_LOG_GROUP:
            props["logConfiguration"] = {"logDriver": "awslogs", "options": {
                "awslogs-group": self.settings["log_group"], "awslogs-region": self.region,
                "awslogs-stream-prefix": "fiber"}}
        if mounts:
            props.update(volumes(mounts))
        digest = hashlib.sha256(json.dumps(props, sort_keys=True).encode()).hexdigest()[:16]
        name = f"fiber-{digest}"
        with self._jobdef_lock:
            arn = self._jobdefs.get(name)
            if arn is not None:
                return arn
            try:
                found = call(self.batch, "describe_job_definitions",
                                   jobDefinitionName=name, status="ACTIVE")["jobDefinitions"]
                if found:
                    arn = max(found, key=lambda d: d["revision"])["jobDefinitionArn"]
                else:
                    arn = call(self.batch, "register_job_definition", jobDefinitionName=name,
                                     type="container", containerProperties=props,
                                     tags={"fiber": "job-definition"})["jobDefinitionArn"]
            except AwsError as e:
                raise self._error(e, f"cannot register a job definition for image {image} on "
                                  f"{self._where()}", "check the credentials' batch:DescribeJobDefinitions "
                                  "and batch:RegisterJobDefinition permissions") from None
            self._jobdefs[name] = arn
            if secrets:
                self._secret_jobdefs.append(arn)
            return arn

    def _job_name(self, name: str) -> str:
        with self._lock:
            self._count += 1
            n = self._count
        return job_name(self.run_id, n, name)

    # -- the contract ------------------------------------------------------------------

    def create_job(self, spec: JobSpec) -> Job:
        for i in range(1, len(spec.alternatives)):  # every alternative has a queue: known before the first is submitted
            self.queue_for(choice_spec(spec, i))
        return self._submit([spec])[0]

    def create_jobs(self, specs: Sequence[JobSpec]) -> list[Job]:
        """Start several jobs: identical specs as one array job (one ``SubmitJob`` for all of them).

        Each child of the array job (``PARENT:INDEX``) is a :class:`Job`, watched, stopped and
        explained like any other; its command tells it apart by ``AWS_BATCH_JOB_ARRAY_INDEX``.
        """
        if 2 <= len(specs) <= _MAX_ARRAY and len(specs[0].alternatives) < 2:  # alternatives move one by one
            if all(s == specs[0] for s in specs):
                return self._submit(specs)
            common = group_spec(specs)
            if common is not None:
                return self._submit(specs, common)
        return super().create_jobs(specs)

    def _submit(self, specs: Sequence[JobSpec], common: JobSpec | None = None) -> list[Job]:
        """Submit ``specs`` (one, or several as an array job whose children all run
        ``common``, by default the first); return their jobs."""
        job_id, handle = self._send(choice_spec(common or specs[0], 0), len(specs))
        ids = [job_id] if len(specs) == 1 else [f"{job_id}:{i}" for i in range(len(specs))]
        jobs = [self.track_job(Job(id=i, spec=s, handle=dataclasses.replace(handle)))
                for i, s in zip(ids, specs)]
        self._poller.ensure()
        return jobs

    def next_choice(self, job: Job) -> None:
        """Move a job that waited ``fallback_wait`` for capacity to the queue of its next GPU
        alternative: terminate its Batch job (nothing of it ran) and submit it again there;
        the job's id becomes the new Batch job's."""
        old: BatchJob = job.handle
        index = old.choice + 1
        spec = choice_spec(job.spec, index)
        waited = self.settings["fallback_wait"]
        alternatives = job.spec.alternatives
        why = (f"fiber: no capacity within fallback_wait={waited:g}s on queue {old.queue}; moved to the queue "
               f"of {alternatives[index]} (run {self.run_id})")
        with self._moving:  # a terminate meanwhile stops the old job, or waits and stops the new one
            if job.handle is not old or old.stop_reason is not None or job.state.done():
                return
            try:
                self.terminate(job, why)
                job_id, handle = self._send(spec, 1)
            except BackendError as e:
                job.state.finish(1, EndReason.NEVER_STARTED, f"could not move {job.spec.name} to its next "
                                                             f"alternative {alternatives[index]}: {e}")
                return
            handle.choice = index
            job.handle = handle
            self.rename_job(job, job_id)
        log.info("fiber: %s found no capacity for %s on queue %s within fallback_wait=%gs; trying %s on queue "
                 "%s (AWS Batch job %s)", job.spec.name, alternatives[index - 1], old.queue, waited,
                 alternatives[index], handle.queue, job_id)

    def submit(self, spec: JobSpec, **more: Any) -> str:
        """Submit ``spec`` as a Batch job that this backend does not follow (no poller watches it,
        its cleanup does not stop it), with ``more`` SubmitJob parameters (``retryStrategy``);
        its id. ``fiber run`` submits the job of the program itself so."""
        return self._send(spec, 1, more)[0]

    def _send(self, spec: JobSpec, count: int, more: Mapping[str, Any] | None = None) -> tuple[str, BatchJob]:
        """Submit ``spec`` (an array job of ``count`` children when more than one, with ``more``
        SubmitJob parameters): the Batch job's id, and the handle its jobs start with."""
        queue, gpus = self.queue_for(spec)
        image = self.job_image(spec)
        vcpus = max(1, math.ceil(spec.cpu)) if spec.cpu else DEFAULT_VCPUS
        memory = spec.memory or DEFAULT_MEMORY
        env = self.job_env(spec)
        parameters = self.parameters.for_job(env, spec.secret_env) if self.settings["key_from"] == "ssm" else {}
        environment, secrets = container_environment(env, parameters)
        jobdef = self.job_definition(image, vcpus, memory, gpus, spec.volumes, secrets)
        name = self._job_name(spec.name)
        try:
            resp = call(
                self.batch, "submit_job", jobName=name, jobQueue=queue, jobDefinition=jobdef,
                containerOverrides={
                    "command": command(spec),
                    "environment": environment,
                    "resourceRequirements": resources(vcpus, memory, gpus),
                },
                tags=tags(spec, self.run_id), **({"arrayProperties": {"size": count}} if count > 1 else {}),
                **(more or {}),
            )
        except AwsError as e:
            hint = (f"check that job queue {queue!r} exists in {self.region} and is ENABLED "
                    "([aws] queue / gpu_queues)") if e.code in ("ClientException", "") else \
                "check the credentials' batch:SubmitJob permission and the endpoint"
            raise self._error(e, f"AWS Batch did not accept {spec.name} on queue {queue!r}", hint) from None
        return resp["jobId"], BatchJob(job_name=name, queue=queue, memory=memory)

    def terminate_job(self, job: Job) -> None:
        self.terminate(job, f"fiber: terminated by its parent (run {self.run_id})")

    def terminate(self, job: Job, reason: str) -> None:
        with self._moving:
            self._terminate(job, reason)

    def _terminate(self, job: Job, reason: str) -> None:
        handle: BatchJob = job.handle
        with self._lock:
            if job.state.done() or handle.stop_reason is not None:
                return
            handle.stop_reason = reason
        try:
            call(self.batch, "terminate_job", jobId=job.id, reason=reason)
        except AwsError as e:
            with self._lock:
                handle.stop_reason = None
            raise self._error(e, f"cannot terminate AWS Batch job {job.id} on {self._where()}",
                              "check the credentials' batch:TerminateJob permission") from None
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
                for d in call(self.batch, "describe_jobs", jobs=[job.id])["jobs"]:
                    handle.log_stream = log_stream(d)
            except AwsError:
                pass
        lines = []
        if handle.log_stream:
            try:
                lines += self._log_lines(handle.log_stream)
            except AwsError as e:
                lines.append(f"fiber-aws: cannot read the job's logs ({self.settings['log_group']}/"
                             f"{handle.log_stream}): {e}")
        explanation = explain(job)
        if explanation:
            lines.append(explanation)
        return "\n".join(lines) + ("\n" if lines else "")

    def _log_lines(self, stream: str, limit: int = 100_000) -> list[str]:
        lines: list[str] = []
        kwargs: dict[str, Any] = {"logGroupName": self.settings["log_group"], "logStreamName": stream,
                                  "startFromHead": True}
        while len(lines) < limit:
            resp = call(self.client("logs"), "get_log_events", **kwargs)
            lines += [e["message"].rstrip("\n") for e in resp.get("events", [])]
            token = resp.get("nextForwardToken")
            if not resp.get("events") or not token or token == kwargs.get("nextToken"):
                break
            kwargs["nextToken"] = token
        return lines

    def get_listen_addr(self) -> str:
        """This machine's address in the VPC of the jobs' compute environments.

        Batch jobs run on instances in the subnets of their queues' compute environments;
        they must be able to open a TCP connection to this process. (Fiber asks only when
        ``listen_host`` is not set.)
        """
        networks = self.job_networks()
        local = local_ipv4_addresses()
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
        queues = self.all_queues()
        networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        try:
            subnets: list[str] = []
            if queues:
                for ce in self.environments(queues):
                    subnets += (ce.get("computeResources") or {}).get("subnets", [])
            if subnets:
                vpc_ids = {s["VpcId"] for s in call(self.client("ec2"), "describe_subnets",
                                                          SubnetIds=sorted(set(subnets)))["Subnets"]}
                for vpc in call(self.client("ec2"), "describe_vpcs", VpcIds=sorted(vpc_ids))["Vpcs"]:
                    blocks = [a["CidrBlock"] for a in vpc.get("CidrBlockAssociationSet", [])
                              if a.get("CidrBlockState", {}).get("State", "associated") == "associated"]
                    for block in blocks or [vpc["CidrBlock"]]:
                        networks.append(ipaddress.ip_network(block, strict=False))
        except AwsError as e:
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
        jobs = self.take_jobs()  # the unfinished ones: the poller follows them until Batch reports their ends
        self._poller.follow_stopping(jobs)
        pending = [j for j in jobs if j.handle.stop_reason is None]
        reason = f"fiber: the parent process exited (run {self.run_id})"

        def stop(job: Job) -> None:
            job.state.stop_requested = True
            try:
                self.terminate(job, reason)
            except BackendError as e:
                log.warning("fiber: %s", e)

        remove_all(pending, stop, limit=8)  # in threads while they can start, else one by one
        self._drop_key()  # the terminated jobs have read it long ago, or will never run
        super().cleanup()
        try:
            self._poller.ensure()
        except RuntimeError:
            pass  # at interpreter exit nobody waits for those ends

    @classmethod
    def clean(cls, settings: Mapping[str, Any], run_id: str | None = None) -> list[str]:
        """Terminate the unfinished jobs of ``run_id`` (or of every fiber run) in the configured queues."""
        backend = cls(settings, run_id or "")
        prefix = f"fiber-{run_id}-" if run_id else "fiber-"
        removed = []
        for queue in backend.all_queues():
            try:
                for summary in list_jobs(backend.batch, queue, prefix):
                    if summary.get("status") in FINAL:
                        continue
                    call(backend.batch, "terminate_job", jobId=summary["jobId"], reason=CLEAN_REASON)
                    removed.append(f"AWS Batch job {summary['jobId']} ({summary['jobName']}, queue {queue})")
            except AwsError as e:
                raise backend._error(e, f"cannot list or terminate the jobs in queue {queue!r} on "
                                     f"{backend._where()}", "check the credentials' batch:ListJobs and "
                                     "batch:TerminateJob permissions") from None
        removed += backend.parameters.clean(run_id)
        return removed
