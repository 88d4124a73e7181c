"""``fiber run --backend aws-batch``: launch a program as an AWS Batch job, where its processes become Batch jobs.

``fiber run --backend aws-batch [--queue Q] [--image IMG] [--env K=V] python app.py`` submits
one Batch job (the *program's job*) running the command with ``FIBER_BACKEND=aws-batch`` and
the ``[aws]`` settings made on this machine, follows its log (CloudWatch Logs) until it ends,
and exits with its exit status (``--detach``: print the job's id and exit). The program's job
needs AWS permissions of its own to submit its processes' jobs: the ``job_role`` setting
(``FIBER_AWS_JOB_ROLE``). No credentials and no key go into the job: the program makes its
own run's key when it starts, and gives it to its jobs as the backend does (``key_from``).
``--durable`` gives the job a retry strategy that starts the program again when its host is
lost (see :mod:`fiber_aws.durable`); with a journal in S3 it picks up where it was.
"""

from __future__ import annotations

import argparse
import signal
import sys
import uuid
from typing import Any

from fiber_core.contract import ENV_RUN_ID, ConfigError, JobSpec, parse_pairs

# The one import of a plugin beyond the contract, named in its import contract (pyproject.toml):
# a command of the CLI, it forwards the settings made here, which only the runtime resolves.
from fiber_core.runtime.config import config

from fiber_aws import durable
from fiber_aws.api import AwsError, call
from fiber_aws.backend import AwsBatchBackend
from fiber_aws.spec import credential_variables

NOT_FORWARDED = {"backend", "listen_host", "listen_port", "image"}
"""Settings of this machine that mean nothing in the program's job. (``image``: its jobs use
the program's own image, forwarded as ``FIBER_AWS_IMAGE``.)"""


def add_options(p: argparse.ArgumentParser) -> None:
    """Add the options of ``fiber run`` on AWS Batch to its parser (which has ``--backend`` and the command)."""
    p.description = __doc__
    p.add_argument("--image", help="image of the program's job and, by default, of its jobs "
                                    "(default: the [aws] image setting, else the image setting)")
    p.add_argument("--queue", help="job queue of the program's job (default: the first of the [aws] queue setting)")
    p.add_argument("--cpu", type=float, help="vCPUs of the program's job")
    p.add_argument("--memory", type=int, help="memory of the program's job, MiB")
    p.add_argument("--gpu", type=int, help="GPUs of the program's job")
    p.add_argument("--gpu-type", help="GPU type of the program's job (its queue: [aws] gpu_queues)")
    p.add_argument("--name", default="fiber-run", help="base of the program's job's name")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="set in the program's job")
    p.add_argument("--volume", action="append", default=[], metavar="/HOST/PATH:PATH",
                   help="mount a path of the container instance in the program's job")
    p.add_argument("--durable", action="store_true",
                   help="retry the program's job when its host is lost (give it a journal in S3: "
                        "--env FIBER_JOURNAL=s3://bucket/prefix)")
    p.add_argument("--retries", type=int, default=0,
                   help="with --durable: retries after the program's own failures too; AWS Batch counts "
                        "every attempt, so the job then has retries + 1 attempts in all (default 0: "
                        f"{durable.MAX_ATTEMPTS} attempts, for lost hosts only)")
    p.add_argument("--detach", action="store_true", help="submit the job, print its id and exit")
    p.set_defaults(func=run)


def job_spec(args: argparse.Namespace, settings: dict[str, Any], run_id: str) -> JobSpec:
    """The program's job: its command, image, resources and environment; a ConfigError for bad input."""
    image = args.image or settings.get("image") or config.get("image")
    if not image:
        raise ConfigError("fiber run needs an image: --image IMAGE, or the image setting (FIBER_AWS_IMAGE)")
    given = parse_pairs(args.env, "--env")
    leaked = credential_variables(args.env)
    if leaked:
        raise ConfigError(f"--env {', '.join(leaked)}: AWS credentials never go into a job (anyone allowed "
                          "batch:DescribeJobs reads them): give the program's job a role, [aws] job_role "
                          "(FIBER_AWS_JOB_ROLE)")
    volumes = {}
    for item in args.volume:
        source, sep, target = item.partition(":")
        if not sep or not source.startswith("/") or not target.startswith("/"):
            raise ConfigError(f"--volume {item!r}: expected /HOST/PATH:/PATH (a path of the container instance)")
        volumes[source] = target
    # A durable run's every start is a run of its own (its jobs, its key); the job's tag ties them.
    own = {"FIBER_JOURNAL_WAIT": str(durable.JOURNAL_WAIT)} if args.durable else {ENV_RUN_ID: run_id}
    env = {**config.made_here("fiber", NOT_FORWARDED),
           **config.made_here(AwsBatchBackend.settings_section(), NOT_FORWARDED),
           "FIBER_AWS_IMAGE": image, "FIBER_BACKEND": AwsBatchBackend.name, **own, **given}
    return JobSpec(command=list(args.cmd), name=args.name, image=image, env=env, cpu=args.cpu,
                   memory=args.memory, gpu=args.gpu, gpu_type=args.gpu_type, volumes=volumes,
                   labels={"fiber.run": run_id, "fiber.role": "main"})


def journal_warning(env: dict[str, str], volumes: dict[str, str]) -> str | None:
    """What to say of a durable run's journal setting, if anything: none, or one in the job's container."""
    journal = env.get("FIBER_JOURNAL")
    if not journal:
        return ("--durable without a journal: each start runs the program from its beginning; give it one "
                "that outlives the host: --env FIBER_JOURNAL=s3://bucket/prefix")
    if "://" not in journal and not any(journal == t or journal.startswith(t.rstrip("/") + "/")
                                        for t in volumes.values()):
        return (f"--durable with FIBER_JOURNAL={journal}, a path inside the job's container: it is lost with "
                "its host; put it in S3 (s3://bucket/prefix) or on a --volume")
    return None


def run(args: argparse.Namespace) -> int:
    """The ``fiber run`` command on AWS Batch; returns the program's exit status."""
    settings = config.backend_settings(AwsBatchBackend.settings_section())
    if args.queue:
        settings["queue"] = args.queue
    run_id = uuid.uuid4().hex[:12]
    spec = job_spec(args, settings, run_id)
    extra: dict[str, Any] = {}
    if args.durable:
        try:
            extra["retryStrategy"] = durable.retry_strategy(args.retries)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        warning = journal_warning(spec.env, spec.volumes)
        if warning:
            print(f"fiber run: warning: {warning}", file=sys.stderr)
    elif args.retries:
        raise ConfigError("--retries is for --durable runs: add --durable")
    if not settings.get("job_role"):
        print("fiber run: warning: no job_role setting: the program's job has only its instance's AWS "
              "permissions to submit its processes' jobs (FIBER_AWS_JOB_ROLE)", file=sys.stderr)
    backend = AwsBatchBackend(settings, run_id)
    job_id = backend.submit(spec, **extra)
    if args.detach:
        print(job_id)
        return 0
    print(f"fiber run: AWS Batch job {job_id} (image {spec.image}, run {run_id}"
          f"{', durable' if args.durable else ''})", file=sys.stderr)
    try:
        return durable.follow(backend.batch, backend.client("logs"), settings["log_group"], job_id,
                              poll=settings["poll_interval"])
    except KeyboardInterrupt:
        print(f"fiber run: interrupted: terminating AWS Batch job {job_id}", file=sys.stderr)
        try:
            call(backend.batch, "terminate_job", jobId=job_id, reason=f"fiber run: interrupted (run {run_id})")
        except AwsError as e:
            print(f"fiber run: cannot terminate AWS Batch job {job_id}: {e}", file=sys.stderr)
        return 128 + signal.SIGINT
