"""Where the test Docker daemon is: the private dockerd of ``scripts/services/docker.sh``.

(Its own module, not conftest.py: the test directories of several plugins run in one
pytest session, and ``import conftest`` would find whichever came first.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fiber_core.testing import service_missing

SERVICES = Path(os.environ.get("FIBER_SERVICES_DIR", "/tmp/fiber-services"))
IMAGE = os.environ.get("FIBER_DOCKER_TEST_IMAGE") or "fiber-test:latest"
"""The image with fiber_core that the tests run their jobs in: the one the services built from
their checkout, unless ``FIBER_DOCKER_TEST_IMAGE`` names one built from another (a branch
whose wire version differs cannot talk to the services' image)."""
NOFIBER_IMAGE = "fiber-test-nofiber:latest"
NOPYTHON_IMAGE = "fiber-test-nopython:latest"
UP = "bash scripts/test-services.sh up docker"


def docker_host() -> str:
    """DOCKER_HOST of the test daemon; skips the test where Docker cannot run."""
    if os.geteuid() != 0:
        pytest.skip("the test Docker daemon (scripts/services/docker.sh) runs as root; not root here")
    try:
        lines = (SERVICES / "docker" / "env").read_text().splitlines()
    except OSError:
        service_missing(f"the test Docker daemon is not up ({SERVICES}/docker/env is missing): {UP}")
    env = dict(line.split("=", 1) for line in lines if "=" in line)
    return env["DOCKER_HOST"]
