"""Calls to AWS: botocore's errors as one exception type, job listings, and this machine's
addresses. The I/O helpers of :mod:`fiber_aws.backend` and its poller."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator
from typing import Any

_THROTTLED = {"ThrottlingException", "Throttling", "TooManyRequestsException",
              "RequestLimitExceeded", "SlowDown"}


class AwsError(Exception):
    """A failed AWS call, stripped of botocore's types (so this module need not import them)."""

    def __init__(self, operation: str, code: str, message: str, unreachable: bool = False) -> None:
        super().__init__(f"{operation}: {code}: {message}" if code else f"{operation}: {message}")
        self.code = code
        self.message = message
        self.throttled = code in _THROTTLED
        self.unreachable = unreachable
        """The endpoint did not answer (no connection, or a timeout): no permission is at fault."""


def call(client: Any, operation: str, **kwargs: Any) -> dict[str, Any]:
    """One AWS call; botocore's errors become :class:`AwsError`."""
    from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError
    from botocore.exceptions import ConnectionError as BotoConnectionError

    try:
        return getattr(client, operation)(**kwargs)
    except ClientError as e:
        err = e.response.get("Error", {})
        raise AwsError(operation, err.get("Code", ""), err.get("Message", str(e))) from e
    except BotoCoreError as e:
        unreachable = isinstance(e, (BotoConnectionError, HTTPClientError))
        raise AwsError(operation, type(e).__name__, str(e), unreachable) from e


def list_jobs(batch: Any, queue: str, prefix: str) -> Iterator[dict[str, Any]]:
    """The summaries of the jobs in ``queue`` whose names start with ``prefix`` (ListJobs)."""
    kwargs: dict[str, Any] = {"jobQueue": queue, "filters": [{"name": "JOB_NAME", "values": [prefix + "*"]}]}
    while True:
        resp = call(batch, "list_jobs", **kwargs)
        yield from resp.get("jobSummaryList", [])
        if not resp.get("nextToken"):
            return
        kwargs["nextToken"] = resp["nextToken"]


def local_ipv4_addresses() -> list[ipaddress.IPv4Address]:
    """The IPv4 address of each network interface of this machine (Linux), without any traffic."""
    try:
        import fcntl
        import struct
    except ImportError:
        return []
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                     struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            out.append(ipaddress.IPv4Address(packed[20:24]))
    return out
