"""fiber-shell held to Fiber's backend conformance suite."""

from __future__ import annotations

from fiber_core.contract.registry import registry
from fiber_core.testing import BackendConformance

import fiber_shell


def test_installed_and_registered() -> None:
    info = {b.name: b for b in registry.backends()}["shell"]
    assert info.cls is fiber_shell.ShellBackend
    assert info.package == "fiber-shell"


class TestShell(BackendConformance):
    backend_name = "shell"
