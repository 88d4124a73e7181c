"""The ``fiber`` command: ``fiber backends`` and ``fiber config``, run as a real command."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

T = 30.0


def fiber(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fiber_core.cli", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=T)


def rows(output: str) -> dict[str, list[str]]:
    """The table lines of ``output``, by their first column."""
    return {line.split()[0]: line.split() for line in output.splitlines() if line.strip()}


def test_backends() -> None:
    out = fiber("backends")
    assert out.returncode == 0, out.stderr
    table = rows(out.stdout)
    assert table["NAME"] == ["NAME", "ALIASES", "PACKAGE", "VERSION"]
    assert table["local"] == ["local", "-", "fiber-core", importlib.metadata.version("fiber-core")]


def test_backends_lists_an_installed_plugin(toy_dist: dict[str, str]) -> None:
    out = fiber("backends", env=toy_dist)
    assert out.returncode == 0, out.stderr
    assert rows(out.stdout)["toy"] == ["toy", "plaything", "fiber-toy", "0.3"]


def test_console_script() -> None:
    script = Path(sys.executable).with_name("fiber")
    if not script.exists():
        pytest.skip("the fiber console script is not installed next to this python")
    out = subprocess.run([str(script), "backends"], capture_output=True, text=True, timeout=T)
    assert out.returncode == 0, out.stderr
    assert "local" in rows(out.stdout)


def test_config_shows_values_and_sources(tmp_path: Path) -> None:
    path = tmp_path / ".fiberconfig"
    path.write_text("[fiber]\nlisten_port = 4321\n")
    out = fiber("config", env={"FIBER_DEBUG": "yes"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "backend in use: local"
    table = rows("\n".join(lines[1:]))
    assert table["debug"] == ["debug", "True", "env", "FIBER_DEBUG"]
    assert table["listen_port"] == ["listen_port", "4321", str(path), "[fiber]"]
    assert table["forward_output"] == ["forward_output", "True", "default"]
    assert table["backend"] == ["backend", "local", "default"]


def test_config_of_a_plugin_backend(tmp_path: Path, toy_dist: dict[str, str]) -> None:
    (tmp_path / ".fiberconfig").write_text("[fiber]\nbackend = plaything\n")
    out = fiber("config", env=toy_dist)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "backend in use: toy"


@pytest.mark.parametrize("env, config_file, expected", [
    ({"FIBER_LISTEN_PORT": "eighty"}, None, "FIBER_LISTEN_PORT"),
    ({}, "[fiber]\nmemory = lots\n", "memory in [fiber]"),
    ({}, "[fiber\n", "malformed"),
    ({}, "[fiber]\nbakend = local\n", "'bakend'"),
    ({"FIBER_BACKEND": "nomad"}, None, "unknown backend 'nomad'"),
], ids=["bad-env", "bad-file-value", "malformed-file", "unknown-key", "unknown-backend"])
def test_config_errors(tmp_path: Path, env: dict[str, str], config_file: str | None, expected: str) -> None:
    if config_file is not None:
        (tmp_path / ".fiberconfig").write_text(config_file)
    out = fiber("config", env=env)
    assert out.returncode == 2
    assert out.stderr.startswith("fiber: error: ")
    assert expected in out.stderr
    assert "Traceback" not in out.stderr


def test_unknown_backend_hint() -> None:
    # The pip hints for the project's own backends are tested in test_registry.py with
    # the installed plugins hidden; here, that the command reports the error cleanly.
    out = fiber("config", env={"FIBER_BACKEND": "nomad"})
    assert out.returncode == 2
    assert "unknown backend 'nomad'" in out.stderr and "its own package" in out.stderr
    assert "Traceback" not in out.stderr
