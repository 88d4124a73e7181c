"""Registers the ``docker`` backend with Fiber (entry point ``fiber``: ``docker``)."""

from __future__ import annotations

from typing import Any

from fiber_core.contract import hookimpl


@hookimpl
def fiber_register_backends(register: Any) -> None:
    # Imported here: a program only asking which backend to use (detection) never loads it.
    from fiber_docker.backend import DockerBackend

    register(DockerBackend)
