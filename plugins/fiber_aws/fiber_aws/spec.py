"""The Batch job of a Fiber job: pure translations of a :class:`~fiber_core.contract.JobSpec`
and the backend's settings into what AWS Batch is given (queue, job definition properties,
resources, command, name, tags), and a group start as one array job. No AWS call."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fiber_core.contract import (
    ENV_GROUP,
    ENV_GROUP_INDEX,
    PER_MEMBER_VARIABLES,
    BackendError,
    ConfigError,
    JobSpec,
    clean_name,
    gpu_count,
)

_CREDENTIAL_WORDS = re.compile(r"secret|access_?key|session_?token|password|credential", re.I)
_AWS_CREDENTIAL_ENV = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}
_ACCESS_KEY_ID = re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b")

SECTION = "aws"
"""Configuration section: ``[aws]`` in ``.fiberconfig``, ``FIBER_AWS_*``, ``init(aws_...)``."""
_TAG_CHARS = re.compile(r"[^\w .:/=+\-@]")


def parse_gpu_queues(entries: list[str]) -> dict[str, str]:
    """``["a10g:queue-a", "V100:queue-b"]`` to ``{"a10g": "queue-a", "v100": "queue-b"}``: the
    first queue of each type (a type listed again names more queues: :func:`queue_lists`)."""
    return {t: qs[0] for t, qs in queue_lists(None, entries).items() if t is not None}


def queue_lists(queue: str | None, entries: list[str]) -> dict[str | None, list[str]]:
    """Every queue of each GPU type (``None``: CPU jobs, the ``queue`` setting, which may list
    several, comma-separated), in the order written; the first is a job's unless it asks for a
    capacity kind (:func:`capacity_queue`)."""
    out: dict[str | None, list[str]] = {}
    cpu = [q.strip() for q in (queue or "").split(",") if q.strip()]
    if cpu:
        out[None] = cpu
    for entry in entries:
        gpu_type, sep, name = entry.partition(":")
        if not sep or not gpu_type.strip() or not name.strip():
            raise ConfigError(
                f"bad gpu_queues entry {entry!r} in [{SECTION}]: expected GPU_TYPE:QUEUE, "
                "e.g. gpu_queues = a10g:gpu-a10g-queue,v100:gpu-v100-queue"
            )
        listed = out.setdefault(gpu_type.strip().lower(), [])
        if name.strip() not in listed:
            listed.append(name.strip())
    return out


def capacity_queue(kind: str, candidates: Sequence[str], kinds: Mapping[str, str], what: str) -> str:
    """The first of ``candidates`` (the queues of a job's hardware) whose compute environments
    are of capacity ``kind`` (``kinds``: queue -> ``"spot"`` or ``"on-demand"``), else a
    BackendError naming each candidate's kind; ``what`` names the job's hardware."""
    for queue in candidates:
        if kinds.get(queue) == kind:
            return queue
    found = ", ".join(f"{q} ({kinds.get(q, 'unknown')})" for q in candidates) or "none"
    raise BackendError(
        f"no job queue of {kind} capacity for {what}: its queues are {found}. Add a queue whose compute "
        f"environments are {'SPOT or FARGATE_SPOT' if kind == 'spot' else 'EC2 or FARGATE'} to [aws] "
        "gpu_queues (a type may be listed once per queue) or queue (several, comma-separated)")


def queue_for(spec: JobSpec, queue: str | None, gpu_queues: Mapping[str, str]) -> tuple[str, int]:
    """The job queue for ``spec`` and its GPU count: ``queue`` for CPU jobs, the queue of its
    GPU type in ``gpu_queues``; BackendError if none is configured."""
    gpus = gpu_count(spec)
    if gpus < 0:
        raise BackendError(
            f"{spec.name} asks for gpu={gpus} (every GPU of the node); AWS Batch needs a count: "
            "request gpu=N"
        )
    if not gpus:
        if not queue:
            raise BackendError(
                f"no job queue for CPU jobs ({spec.name}): set [aws] queue in .fiberconfig "
                "(FIBER_AWS_QUEUE) to an AWS Batch job queue"
            )
        return queue, 0
    configured = ", ".join(f"{t} -> {q}" for t, q in gpu_queues.items()) or "none"
    if spec.gpu_type is None:
        if len(gpu_queues) == 1:
            return next(iter(gpu_queues.values())), gpus
        raise BackendError(
            f"{spec.name} asks for {gpus} GPU(s) without a GPU type, and the GPU queues are "
            f"({configured}): say which with meta(gpu_type=...) or configure exactly one "
            "in [aws] gpu_queues"
        )
    found = gpu_queues.get(spec.gpu_type.lower())
    if found is None:
        raise BackendError(
            f"no job queue for GPU type {spec.gpu_type!r} ({spec.name}); configured GPU "
            f"queues: {configured}. Add one to [aws] gpu_queues (FIBER_AWS_GPU_QUEUES="
            f"{spec.gpu_type.lower()}:QUEUE,...) or request a configured type"
        )
    return found, gpus


def resources(vcpus: int, memory: int, gpus: int) -> list[dict[str, str]]:
    """Batch's ``resourceRequirements`` for these vCPUs, MiB of memory and GPUs."""
    out = [{"type": "VCPU", "value": str(vcpus)}, {"type": "MEMORY", "value": str(memory)}]
    if gpus:
        out.append({"type": "GPU", "value": str(gpus)})
    return out


def volumes(mounts: Mapping[str, str]) -> dict[str, list[dict[str, Any]]]:
    """A job definition's ``volumes`` and ``mountPoints`` for ``{host path: container path}``."""
    out: dict[str, list[dict[str, Any]]] = {"volumes": [], "mountPoints": []}
    for i, (source, target) in enumerate(sorted(mounts.items())):
        if not source.startswith("/"):
            raise BackendError(
                f"volume {source!r}: AWS Batch mounts host paths only; use an absolute path "
                "on the container instance (or EFS in your own job definition)"
            )
        out["volumes"].append({"name": f"v{i}", "host": {"sourcePath": source}})
        out["mountPoints"].append({"sourceVolume": f"v{i}", "containerPath": target, "readOnly": False})
    return out


def command(spec: JobSpec) -> list[str]:
    """The job's command, started in ``spec.cwd`` when it names one."""
    if spec.cwd:
        return ["/bin/sh", "-c", 'cd "$0" && exec "$@"', spec.cwd, *spec.command]
    return list(spec.command)


def run_part(run_id: str) -> str:
    """The run id as it appears in job names."""
    return clean_name(run_id, "A-Za-z0-9_-", sub="", edges="", fallback="run")


def job_name(run_id: str, n: int, name: str) -> str:
    """``fiber-<run>-<n>-<name>``, in the characters and length Batch allows."""
    return f"fiber-{run_part(run_id)}-{n}-{re.sub(r'[^A-Za-z0-9_-]', '-', name)}"[:128]


def sanitise_tag(text: str, limit: int) -> str:
    """``text`` as a tag key or value: characters Batch refuses become ``_``, at most ``limit``."""
    return _TAG_CHARS.sub("_", text)[:limit]


def tags(spec: JobSpec, run_id: str) -> dict[str, str]:
    """The job's tags: its labels, and ``fiber.run``."""
    out = {sanitise_tag(k, 128): sanitise_tag(v, 256) for k, v in spec.labels.items()}
    out.setdefault("fiber.run", sanitise_tag(run_id, 256))
    return out


def group_spec(specs: Sequence[JobSpec]) -> JobSpec | None:
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


ENVIRONMENT_LIMIT = 24 * 1024
"""Bytes of a job's plain environment (as JSON) at most: SubmitJob takes 30 KiB in all, and the
command, tags and resources need the rest."""


def container_environment(env: Mapping[str, str], parameters: Mapping[str, str]) -> tuple[
        list[dict[str, str]], list[dict[str, str]]]:
    """(``environment``, ``secrets``) of a job's container: the variables of ``env`` in plain,
    less those that ``parameters`` (variable: SSM parameter) gives by reference, which the
    job definition's ``secrets`` name and the execution role injects. An environment too big
    for SubmitJob (:data:`ENVIRONMENT_LIMIT`) is a BackendError naming its biggest variables."""
    plain = [{"name": k, "value": v} for k, v in env.items() if k not in parameters]
    hidden = [{"name": k, "valueFrom": parameters[k]} for k in sorted(parameters)]
    size = len(json.dumps(plain))
    if size > ENVIRONMENT_LIMIT:
        biggest = sorted(plain, key=lambda e: -len(e["name"]) - len(e["value"]))[:3]
        raise BackendError(
            f"the job's environment takes {size} bytes, more than AWS Batch's SubmitJob allows "
            f"({ENVIRONMENT_LIMIT}); the biggest: {', '.join(e['name'] for e in biggest)}. Leave the "
            f"program's variables out with [{SECTION}] env_exclude (FIBER_AWS_ENV_EXCLUDE) or "
            "meta(env_exclude=[...]), or pass none with env_pass = false")
    return plain, hidden


def credential_variables(entries: Iterable[str]) -> list[str]:
    """The names of the ``KEY=VALUE`` ``entries`` that carry AWS credentials."""
    return [item.partition("=")[0].strip() for item in entries
            if item.partition("=")[0].strip().upper() in _AWS_CREDENTIAL_ENV or _ACCESS_KEY_ID.search(item)]


def refuse_credentials(settings: Mapping[str, Any], known: set[str]) -> None:
    """Fail if anything that looks like an AWS credential reached fiber's configuration
    (``settings``, whose ``known`` option names are not suspect, and the environment)."""
    advice = ("AWS credentials are never read from fiber's configuration: remove it and use the "
              "standard boto3 chain (AWS_PROFILE, ~/.aws/credentials, AWS_ACCESS_KEY_ID and "
              "AWS_SECRET_ACCESS_KEY in the environment, an instance or task role)")
    prefixes = ("FIBER_AWS_", "FIBER_AWS-BATCH_")
    found = [f"environment variable {k}" for k in os.environ
             if k.upper().startswith(prefixes) and _CREDENTIAL_WORDS.search(k.split("_", 2)[-1])
             and k.split("_", 2)[-1].lower() not in known]
    found += [f"setting {k!r}" for k in settings
              if k not in known and _CREDENTIAL_WORDS.search(k)]
    found += [f"{name} in [{SECTION}] extra_env (give the jobs a job_role instead)"
              for name in credential_variables(settings.get("extra_env") or [])]
    for key, value in settings.items():
        if key != "extra_env" and isinstance(value, str) and _ACCESS_KEY_ID.search(value):
            found.append(f"an access key id in setting {key!r}")
    if found:
        raise ConfigError(f"refusing AWS credentials in fiber's configuration ({'; '.join(found)}). {advice}.")


def choice_spec(spec: JobSpec, choice: int) -> JobSpec:
    """The spec of the Batch job for alternative ``choice`` (0-based) of ``spec``
    (``JobSpec.alternatives``: GPU types within capacity kinds): its type and count, so
    :func:`queue_for` picks its queue, its capacity kind, and the record that tells the job
    what it got. A job that names neither as it is."""
    alternatives = spec.alternatives
    if not alternatives:
        return spec
    return spec.choosing(alternatives[choice])
