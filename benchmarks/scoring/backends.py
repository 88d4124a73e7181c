"""Fiber on each backend the test services provide: its settings, and where its workers' processes are.

Each backend is configured as its plugin's tests configure it (``plugins/*/tests``): the
private dockerd and the ``fiber-test:latest`` image with host networking, the SSH test hosts
of ``hosts.env`` (network namespaces of this machine, two slots each), the Kubernetes API
emulator (a namespace of the cell's own; pods are host-network containers on the test
dockerd). Under ``restart`` the backend talks to its platform through a
:class:`~fiber_core.testing.outage.Outage` that the fault cuts and restores.

Every backend here runs its jobs on this machine (containers and network namespaces share
its process table), so a worker's process is found the same way on each: the processes of
the worker bootstrap whose environment names the run.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SERVICES = Path(os.environ.get("FIBER_SERVICES_DIR", "/tmp/fiber-services"))
ROOT = Path(__file__).resolve().parents[2]
IMAGE = "fiber-test:latest"
WORKER_MODULE = b"fiber_core.processes.worker"
"""What every backend's worker command runs (``python -m ...``); a container's ``docker-init``
and a pod's ``sh -c`` wrapper have it among their arguments too, and are not the worker."""


def read_env(path: Path) -> dict[str, str]:
    """``KEY=value`` lines of a services' env file, shell-quoted values unquoted."""
    out = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = shlex.split(value)[0] if value.strip() else ""
    return out


def ssh_tests() -> None:
    """Makes fiber-ssh's test helpers importable (the hosts' settings, the iptables rules)."""
    path = str(ROOT / "plugins" / "fiber_ssh" / "tests")
    if path not in sys.path:
        sys.path.insert(0, path)


@contextlib.contextmanager
def configured(backend: str, api_outage: bool) -> Iterator[Any]:
    """Sets this process's ``FIBER_*`` settings for ``backend``; yields the API's
    :class:`Outage` when ``api_outage`` (and the backend has an API), else None."""
    env: dict[str, str] = {"FIBER_BACKEND": backend}
    with contextlib.ExitStack() as stack:
        outage = None
        if backend == "docker":
            env.update(docker_settings())
            if api_outage:
                outage = stack.enter_context(docker_outage(env))
        elif backend == "ssh":
            ssh_tests()
            from test_ssh import ENV_FILE, ssh_env

            env.update(ssh_env(read_env(ENV_FILE)))
        elif backend == "kubernetes":
            env.update(kubernetes_settings())
            if api_outage:
                outage = stack.enter_context(kubernetes_outage(env))
        elif backend != "local":
            raise ValueError(f"unknown backend {backend!r} (here: local, docker, ssh, kubernetes)")
        for key in [k for k in os.environ if k.startswith("FIBER_") and k != "FIBER_SERVICES_DIR"]:
            del os.environ[key]
        os.environ.update(env)
        yield outage


def docker_settings() -> dict[str, str]:
    docker_host = read_env(SERVICES / "docker" / "env")["DOCKER_HOST"]
    os.environ["DOCKER_HOST"] = docker_host
    return {"FIBER_DOCKER_IMAGE": IMAGE, "FIBER_DOCKER_BASE_URL": docker_host}


@contextlib.contextmanager
def docker_outage(env: dict[str, str]) -> Iterator[Any]:
    """dockerd behind a Unix socket that the fault cuts (as ``test_docker.py`` does)."""
    from fiber_core.testing.outage import Outage

    with tempfile.TemporaryDirectory(prefix="scorecard-docker-") as tmp:
        path = os.path.join(tmp, "docker.sock")
        with Outage.unix(path, env["FIBER_DOCKER_BASE_URL"].removeprefix("unix://")) as relay:
            env["FIBER_DOCKER_BASE_URL"] = f"unix://{path}"
            yield relay


def kubernetes_settings() -> dict[str, str]:
    """The emulator's kubeconfig and a new namespace of this cell's (its pods are its own)."""
    from kubernetes import client, config

    kubeconfig = os.environ.get("FIBER_K8S_KUBECONFIG") or str(SERVICES / "k8s" / "kubeconfig")
    namespace = "scorecard-" + uuid.uuid4().hex[:8]
    api = client.CoreV1Api(config.new_client_from_config(kubeconfig))
    api.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    return {"FIBER_KUBERNETES_KUBECONFIG": kubeconfig, "FIBER_KUBERNETES_NAMESPACE": namespace,
            "FIBER_KUBERNETES_IMAGE": IMAGE, "FIBER_LISTEN_HOST": "127.0.0.1"}


@contextlib.contextmanager
def kubernetes_outage(env: dict[str, str]) -> Iterator[Any]:
    """The API server behind a TCP forwarder that the fault cuts (as ``test_kubernetes.py`` does)."""
    from urllib.parse import urlsplit

    import yaml

    from fiber_core.testing.outage import Outage

    kubeconfig = yaml.safe_load(Path(env["FIBER_KUBERNETES_KUBECONFIG"]).read_text())
    cluster = kubeconfig["clusters"][0]["cluster"]
    target = urlsplit(cluster["server"])
    assert target.hostname is not None and target.port is not None
    with tempfile.TemporaryDirectory(prefix="scorecard-k8s-") as tmp, \
            Outage(target.hostname, target.port) as api:
        cluster["server"] = f"{target.scheme}://127.0.0.1:{api.port}"
        through = Path(tmp) / "kubeconfig"
        through.write_text(yaml.safe_dump(kubeconfig))
        env["FIBER_KUBERNETES_KUBECONFIG"] = str(through)
        yield api


# ---------------------------------------------------------------------------------------
# Where the workers are: /proc, the same for every backend here


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def is_worker(argv: list[bytes]) -> bool:
    """Whether a command line is the worker bootstrap's (``PYTHON -m fiber_core.processes.worker``),
    not a container's init or a pod's shell that names it as an argument."""
    return argv[1:3] == [b"-m", WORKER_MODULE]


def run_workers(run_id: str) -> list[int]:
    """The pids of the run's worker processes on this machine that are not stopped, in the
    order they started (a stable worker index)."""
    mark = f"FIBER_RUN_ID={run_id}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if not is_worker(_read(f"/proc/{name}/cmdline").split(b"\0")):
                continue
            if mark not in _read(f"/proc/{name}/environ").split(b"\0"):
                continue
            stat = _read(f"/proc/{name}/stat").rsplit(b")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if stat[0] not in (b"T", b"t", b"Z", b"X"):  # stopped or ended: not a worker to strike
            found.append((int(stat[19]), int(name)))  # the start time, in clock ticks
    return [pid for _, pid in sorted(found)]


def netns_of(pid: int) -> str | None:
    """The name of the network namespace (``ip netns``) that ``pid`` runs in, or None."""
    try:
        inode = os.stat(f"/proc/{pid}/ns/net").st_ino
        names = os.listdir("/run/netns")
    except OSError:
        return None
    for name in names:
        try:
            if os.stat(f"/run/netns/{name}").st_ino == inode:
                return name
        except OSError:
            pass
    return None
