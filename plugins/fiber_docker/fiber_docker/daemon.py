"""Talking to the Docker daemon: the clients, this process's own container, the output and
stdin streams of containers, and removing many containers at once. I/O helpers of
:mod:`fiber_docker.backend`; the docker SDK is imported when they first run."""

from __future__ import annotations

import importlib.metadata
import os
import re
import socket
from collections.abc import Mapping
from typing import Any

from fiber_core.contract import BackendError, Job, remove_all

_CONTAINER_ID = re.compile(r"(?:/containers/|docker[-/]|/docker/)([0-9a-f]{64})")



def connect(settings: Mapping[str, Any], timeout: float) -> tuple[Any, Any, str]:
    """Two clients of the configured daemon, checked to answer, and where it is.

    The first has ``timeout`` (the ``api_timeout`` setting); the second none, for the streams that stay
    open as long as a container runs (attach) or the backend lives (events).
    """
    import docker

    base_url = settings.get("base_url")
    if base_url:
        where, kwargs = base_url, {"base_url": base_url}
        source = "[docker] base_url (FIBER_DOCKER_BASE_URL)"
    else:
        kwargs = docker.utils.kwargs_from_env()
        where = kwargs.get("base_url") or "unix:///var/run/docker.sock"
        source = "DOCKER_HOST" if os.environ.get("DOCKER_HOST") else "Docker's default"
    try:
        api = docker.APIClient(timeout=timeout, **kwargs)
        api.ping()
        streams = docker.APIClient(version=api.api_version, timeout=None, **kwargs)
    except Exception as e:  # DockerException, requests' ConnectionError, a bad URL
        raise BackendError(
            f"cannot reach the Docker daemon at {where} (from {source}). Start Docker, or point "
            "DOCKER_HOST or FIBER_DOCKER_BASE_URL at a running daemon; a user other than root must be "
            "in the docker group to use its socket", cause=e) from None
    return api, streams, where


def own_container(api: Any) -> dict[str, Any] | None:
    """The daemon's view of the container this process runs in, or None."""
    import docker

    candidates: list[str] = []
    for path in ("/proc/self/mountinfo", "/proc/self/cgroup"):
        try:
            with open(path) as f:
                candidates += _CONTAINER_ID.findall(f.read())
        except OSError:
            pass
    host = socket.gethostname()
    if re.fullmatch(r"[0-9a-f]{12}", host):
        candidates.append(host)
    for cid in dict.fromkeys(candidates):
        try:
            attrs = api.inspect_container(cid)
        except docker.errors.APIError:
            continue
        if attrs["Id"].startswith(cid) and (cid != host or attrs["Config"].get("Hostname") == host):
            return attrs
    return None


def read_output(stream: Any, job: Job) -> None:
    try:
        for chunk in stream:
            job.state.log.append(chunk)
    except Exception:
        pass
    finally:
        job.handle.output_done.set()
        close_stream(stream)


def send_and_close(sock: Any, data: bytes) -> None:
    """Write ``data`` on a container's attached stdin and detach (its stdin then ends)."""
    raw = getattr(sock, "_sock", sock)  # docker's SocketIO wraps the socket
    try:
        raw.sendall(data)
    finally:
        raw.close()
        if raw is not sock:
            sock.close()


def close_stream(stream: Any) -> None:
    """Close a docker SDK stream that no thread reads any more, and its HTTP response.

    Closing the response blocks while another thread reads it: only the reader calls this.

    Left to the garbage collector, the response of an attach stream may be closed after its
    file, which prints "Exception ignored ... I/O operation on closed file" (Python 3.13).
    """
    for close in (getattr(getattr(stream, "_response", None), "close", None), stream.close):
        if close is not None:
            try:
                close()
            except Exception:
                pass


def remove_containers(api: Any, ids: list[str]) -> None:
    """Kill and remove containers, several at a time (:func:`~fiber_core.contract.remove_all`)."""
    import docker

    def remove(cid: str) -> None:
        try:
            api.remove_container(cid, force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            if e.status_code != 409:  # 409: removal already in progress (--rm)
                raise

    errors = remove_all(ids, remove)
    if errors:
        raise BackendError(f"could not remove {len(errors)} container(s): {explain(errors[0])}")


def core_version() -> str | None:
    """The version of the fiber-core this process runs, if it is installed."""
    try:
        return importlib.metadata.version("fiber-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def explain(e: Any) -> str:
    return str(getattr(e, "explanation", None) or e)
