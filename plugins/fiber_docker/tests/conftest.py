"""The real Docker Engine the tests use: the private dockerd of ``scripts/services/docker.sh``.

Start it with ``bash scripts/test-services.sh up docker``. Tests skip (with the reason)
only where Docker cannot run at all: not root, or the service is not up.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from docker_service import IMAGE, NOFIBER_IMAGE, NOPYTHON_IMAGE, UP
from docker_service import docker_host as _docker_host
from fiber_core.testing import service_missing


@pytest.fixture(scope="session")
def docker_host() -> str:
    return _docker_host()


@pytest.fixture(scope="session")
def docker_api(docker_host: str):  # noqa: ANN201 - a docker.APIClient
    """A client of the test daemon, to look at containers from outside the backend."""
    import docker

    try:
        api = docker.APIClient(base_url=docker_host, timeout=60)
        api.ping()
    except Exception as e:
        service_missing(f"the test Docker daemon at {docker_host} does not answer ({e}): {UP}")
    for image in (IMAGE, NOFIBER_IMAGE, NOPYTHON_IMAGE):
        try:
            api.inspect_image(image)
        except docker.errors.ImageNotFound:
            pytest.fail(f"the test Docker daemon has no {image}: {UP} builds it")
    return api


@pytest.fixture(scope="module")
def docker_env(docker_host: str, docker_api) -> Iterator[None]:  # noqa: ANN001
    """This module's environment: the test daemon and image; nothing inherited that changes them."""
    mp = pytest.MonkeyPatch()
    for var in list(os.environ):
        if var.startswith("FIBER_DOCKER_") or var in ("FIBER_BACKEND", "FIBER_LISTEN_HOST", "FIBER_IMAGE",
                                                      "FIBER_PYTHON", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH"):
            mp.delenv(var)
    mp.setenv("DOCKER_HOST", docker_host)
    mp.setenv("FIBER_DOCKER_IMAGE", IMAGE)
    yield
    mp.undo()
