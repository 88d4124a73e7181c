"""Registers the ``docker`` backend with Fiber (entry point ``fiber``: ``docker``)."""

from __future__ import annotations

from typing import Any

from fiber_core.contract import hookimpl

from fiber_docker.backend import DockerBackend


@hookimpl
def fiber_register_backends(register: Any) -> None:
    register(DockerBackend)
