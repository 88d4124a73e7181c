"""fiber-docker is installed and registered (no Docker needed)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fiber_core.base.errors import BackendError
from fiber_core.runtime.config import plugins
from fiber_core.testing import START_ONE, failing_program

from fiber_docker.backend import DockerBackend


def test_entry_point_and_registration() -> None:
    eps = importlib.metadata.entry_points(group="fiber")
    assert "fiber_docker.plugin" in {ep.value for ep in eps if ep.name == "docker"}
    assert plugins().get_class("docker") is DockerBackend
    info = {b.name: b for b in plugins().backends()}["docker"]
    assert info.package == "fiber-docker"
    assert info.version == importlib.metadata.version("fiber-docker")


def test_docker_sdk_not_imported_by_the_plugin() -> None:
    code = ("import sys, fiber_core; from fiber_core.runtime.config import plugins; "
            "plugins().get_class('docker'); print('docker' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_unreachable_daemon_reads_at_a_glance(tmp_path: Path) -> None:
    """What `FIBER_BACKEND=docker python app.py` prints without a daemon: the user's frame, a few of
    Fiber's, and one line that says what to do; the SDK's chain of exceptions stays out of it."""
    sock = tmp_path / "no-docker.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FIBER_", "DOCKER_"))}
    env.update(FIBER_BACKEND="docker", DOCKER_HOST=f"unix://{sock}")
    for body in (START_ONE, "fiber_core.Pool(2).map(abs, [1, 2])"):
        line, stderr = failing_program(tmp_path, env, body)
        assert line.startswith(f"fiber_core.base.errors.BackendError: cannot reach the Docker daemon at "
                               f"unix://{sock} (from DOCKER_HOST). Start Docker, or point DOCKER_HOST"), line
        assert line.index("FIBER_DOCKER_BASE_URL") < line.index("(cause: docker.errors.DockerException: ")
        assert len(stderr.splitlines()) <= 30, stderr  # the frames of Fiber's own calls, and no more


def test_unreachable_daemon_keeps_the_cause(tmp_path: Path) -> None:
    with pytest.raises(BackendError, match="cannot reach the Docker daemon") as e:
        DockerBackend.clean({"base_url": f"unix://{tmp_path / 'no-docker.sock'}"}, "r")
    import docker

    assert isinstance(e.value.cause, docker.errors.DockerException)
    assert e.value.__context__ is e.value.cause and e.value.__suppress_context__
    assert e.value.__cause__ is None


def test_the_readme_dockerfile_installs_fiber_core_as_the_errors_say() -> None:
    from fiber_core.contract import install_elsewhere

    hint = install_elsewhere(image=True)  # from this checkout: the wheels that build-dists.sh makes
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for line in ("COPY fiber-dist/ /tmp/fiber/", "RUN pip install --find-links /tmp/fiber fiber-core"):
        assert line in hint and f"\n{line}" in readme, line
    assert "pip install fiber-core" not in readme
