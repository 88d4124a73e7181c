"""Registers the ``ssh`` backend with Fiber (entry point ``fiber``: ``ssh = "fiber_ssh.plugin"``)."""

from __future__ import annotations

from typing import Any

from fiber_core.contract import hookimpl


@hookimpl
def fiber_register_backends(register: Any) -> None:
    # Imported here: a program only asking which backend to use (detection) never loads it.
    from fiber_ssh.backend import SshBackend

    register(SshBackend)
