"""The container of a job: pure translations of a :class:`~fiber_core.contract.JobSpec` and
the backend's settings into what the Docker API is given (name, labels, command, environment,
mounts, limits). No call to the daemon: :mod:`fiber_docker.backend` sends what these build.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fiber_core.contract import BackendError, JobSpec, clean_name, split_secrets

LABEL_RUN = "fiber.run"
LABEL_BACKEND = "fiber.backend"
LABEL_OWNER = "fiber.owner"
"""Which backend instance (one per process) created the container: what cleanup() removes."""

SECRETS_SHELL = 'while IFS= read -r v && [ -n "$v" ]; do export "$v"; done; exec "$@"'
"""Runs a job's command with the variables written on its stdin (``NAME=VALUE`` lines, then an
empty one) in its environment: the run's key, the job's token and the variables marked secret,
which would otherwise be in the container's config for anyone allowed ``docker inspect`` to read."""


def container_name(run_id: str, owner: str, n: int, name: str) -> str:
    """``fiber-<run>-<owner>-<n>-<name>``, in the characters Docker allows."""
    return f"fiber-{run_id}-{owner}-{n}-{clean_name(name, edges='-.')}"[:120]


def container_labels(spec: JobSpec, run_id: str, backend: str, owner: str) -> dict[str, str]:
    """The spec's labels and the three that find a run's containers again."""
    return {**{k: str(v) for k, v in spec.labels.items()},
            LABEL_RUN: run_id, LABEL_BACKEND: backend, LABEL_OWNER: owner}


def device_requests(gpu: int | None) -> list[dict[str, Any]] | None:
    """GPUs as Docker device requests: a count, or every GPU for ``-1``."""
    if not gpu:
        return None
    return [{"count": -1 if gpu < 0 else int(gpu), "capabilities": [["gpu"]]}]


def command_and_stdin(command: list[str], env: Mapping[str, str],
                      marked: Sequence[str] = ()) -> tuple[list[str], dict[str, str], bytes]:
    """(argv, environment, stdin) of a container: the secrets of ``env`` (the run's, and the
    names ``marked`` by the user) travel on its stdin, read by :data:`SECRETS_SHELL`, not in
    its config, which ``docker inspect`` shows."""
    public, secret = split_secrets(env, marked)
    for name, value in secret.items():
        if "\n" in value:
            raise BackendError(f"the secret variable {name} holds a line break: the docker backend passes "
                               "secrets on the container's stdin, one per line; encode the value (base64)")
    if not secret:
        return list(command), public, b""
    stdin = "".join(f"{k}={secret[k]}\n" for k in sorted(secret)).encode() + b"\n"
    return ["/bin/sh", "-c", SECRETS_SHELL, "fiber-job", *command], public, stdin


def mounts(spec: JobSpec, settings: Mapping[str, Any], cwd: str, in_container: bool) -> tuple[list[str], str | None]:
    """Bind mounts (``SRC:DST[:MODE]``) and working directory of a job.

    The working directory ``cwd`` is mounted at the same path unless ``mount_cwd`` says no
    (by default: not when this process runs in a container); then the ``volumes`` setting
    and the spec's volumes, a later mount of the same target replacing an earlier one.
    """
    binds: dict[str, str] = {}
    workdir = spec.cwd
    mount_cwd = settings.get("mount_cwd")
    if mount_cwd is None:
        mount_cwd = not in_container
    if mount_cwd and cwd != "/":
        binds[cwd] = f"{cwd}:{cwd}"
        workdir = workdir or cwd
    for entry in settings.get("volumes") or ():
        parts = entry.split(":")
        if len(parts) not in (2, 3) or not parts[0] or not parts[1]:
            raise BackendError(f"bad docker volumes entry {entry!r}: expected SOURCE:TARGET[:ro|rw]")
        binds[parts[1]] = entry
    for source, target in spec.volumes.items():
        binds[target] = f"{source}:{target}"
    return list(binds.values()), workdir


def limits(spec: JobSpec) -> dict[str, Any]:
    """The host-config limits of a job: CPUs, memory (MiB), GPUs."""
    return {"nano_cpus": int(spec.cpu * 1e9) if spec.cpu else None,
            "mem_limit": int(spec.memory) * 1024 * 1024 if spec.memory else None,
            "device_requests": device_requests(spec.gpu)}
