"""Registers the ``aws-batch`` backend (alias ``aws``); its settings live in ``[aws]``."""

from __future__ import annotations

from typing import Any

from fiber_core.contract import hookimpl

from fiber_aws.backend import AwsBatchBackend


@hookimpl
def fiber_register_backends(register: Any) -> None:
    register(AwsBatchBackend)
