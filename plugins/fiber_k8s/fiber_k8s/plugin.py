"""Registers the ``kubernetes`` backend (alias ``k8s``) and the ``fiber run`` command."""

from __future__ import annotations

import argparse
from typing import Any

from fiber_core.contract import hookimpl

from fiber_k8s.backend import KubernetesBackend


@hookimpl
def fiber_register_backends(register: Any) -> None:
    register(KubernetesBackend)


@hookimpl
def fiber_add_commands(subparsers: argparse._SubParsersAction) -> None:
    from fiber_k8s.run import add_command

    add_command(subparsers)
