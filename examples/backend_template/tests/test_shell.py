"""fiber-shell held to Fiber's backend conformance suite."""

from __future__ import annotations

from fiber_core.runtime.config import plugins
from fiber_core.testing import BackendConformance

import fiber_shell


def test_installed_and_registered() -> None:
    info = {b.name: b for b in plugins().backends()}["shell"]
    assert info.cls is fiber_shell.ShellBackend
    assert info.package == "fiber-shell"


class TestShell(BackendConformance):
    backend_name = "shell"
