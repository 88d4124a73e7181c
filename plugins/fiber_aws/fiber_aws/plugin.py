"""Registers the ``aws-batch`` backend (alias ``aws``), whose settings live in ``[aws]``, journals
in S3 (``journal = s3://bucket/prefix``), and ``fiber run --backend aws-batch``."""

from __future__ import annotations

from typing import Any

from fiber_core.contract import hookimpl


@hookimpl
def fiber_register_backends(register: Any) -> None:
    # Imported here: a program only asking which backend to use (detection) never loads it.
    from fiber_aws.backend import AwsBatchBackend

    register(AwsBatchBackend)


@hookimpl
def fiber_journal_store(url: str) -> Any:
    if not url.startswith("s3://"):
        return None
    from fiber_aws.journal import S3Store  # (boto3 with it: only for a journal in S3)

    return S3Store(url)


@hookimpl
def fiber_run_launchers() -> dict[str, Any]:
    from fiber_aws.run import add_options

    return {"aws-batch": add_options}
