"""Registers the ``aws-batch`` backend (alias ``aws``); its settings live in ``[aws]``."""

from __future__ import annotations

from typing import Any

from fiber_core.contract import hookimpl


@hookimpl
def fiber_register_backends(register: Any) -> None:
    # Imported here: a program only asking which backend to use (detection) never loads it.
    from fiber_aws.backend import AwsBatchBackend

    register(AwsBatchBackend)
