"""fiber-docker is installed and registered (no Docker needed)."""

from __future__ import annotations

import importlib.metadata

from fiber_core.runtime.config import plugins

from fiber_docker.backend import DockerBackend


def test_entry_point_and_registration() -> None:
    eps = importlib.metadata.entry_points(group="fiber")
    assert "fiber_docker.plugin" in {ep.value for ep in eps if ep.name == "docker"}
    assert plugins().get_class("docker") is DockerBackend
    info = {b.name: b for b in plugins().backends()}["docker"]
    assert info.package == "fiber-docker"
    assert info.version == importlib.metadata.version("fiber-docker")


def test_docker_sdk_not_imported_by_the_plugin() -> None:
    import subprocess
    import sys

    code = ("import sys, fiber_core; from fiber_core.runtime.config import plugins; "
            "plugins().get_class('docker'); print('docker' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
