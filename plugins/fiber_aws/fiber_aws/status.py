"""Why a Batch job ended: pure translations of the ``DescribeJobs`` entry AWS Batch gives
into the job's exit code and :class:`~fiber_core.contract.EndReason`. No AWS call."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fiber_core.contract import EndReason, Job, exitcode_from_status

CLEAN_REASON = "fiber clean: left behind by a crashed run"
QUEUED = ("SUBMITTED", "PENDING", "RUNNABLE")
FINAL = ("SUCCEEDED", "FAILED")

# What Batch says when a job ends (statusReason, and the container's reason), by EndReason.
_OOM = re.compile(r"OutOfMemoryError", re.I)
_NOT_STARTED = re.compile(r"CannotPullContainerError|CannotStartContainerError|"
                          r"ResourceInitializationError|CannotCreateVolumeError|Task failed to start")
_HOST_LOST = re.compile(r"Host EC2 \(instance [^)]*\) (?:terminated|stopped)", re.I)
_SPOT_WORDS = re.compile(r"spot|interrupt", re.I)


@dataclass(eq=False)
class BatchJob:
    """What the poller knows of one Batch job beyond its ``JobState``: the ``handle`` of its :class:`Job`."""

    job_name: str
    queue: str
    memory: int
    """The memory limit it was submitted with, MiB."""
    submitted: float = field(default_factory=time.monotonic)
    described: dict[str, Any] = field(default_factory=dict)
    """Its latest ``DescribeJobs`` entry (``{}`` before the first)."""
    log_stream: str | None = None
    stop_reason: str | None = None
    """The reason Fiber gave when it terminated the job."""
    note: str | None = None
    """Fiber's own explanation of a failure (no capacity, job lost)."""
    missing: int = 0
    choice: int = 0
    """Which GPU alternative of the job's spec it was submitted for (its queue's)."""

    @property
    def status(self) -> str:
        return str(self.described.get("status", "SUBMITTED"))


def _container(described: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job's ``container`` and its last attempt's, from a ``DescribeJobs`` entry."""
    attempts = described.get("attempts") or [{}]
    return described.get("container") or {}, attempts[-1].get("container") or {}


def exit_status(described: Mapping[str, Any]) -> int | None:
    """The container's exit status in a ``DescribeJobs`` entry (``128 + N`` after signal ``N``)."""
    container, attempt = _container(described)
    status = container.get("exitCode", attempt.get("exitCode"))
    return None if status is None else int(status)


def end_reason(described: Mapping[str, Any], *, stop_reason: str | None = None,
               memory: int | None = None, spot: bool = False) -> tuple[EndReason, str]:
    """Why a finished Batch job ended, and what Batch said, from its ``DescribeJobs`` entry.

    Reads the job's ``statusReason`` and its container's ``reason``: Fiber's own stop
    (``stop_reason``, the reason it gave ``TerminateJob``, or ``fiber clean``'s) is
    STOPPED; ``OutOfMemoryError`` is OOM (with the ``memory`` limit in MiB);
    ``CannotPullContainerError``, ``CannotStartContainerError``,
    ``ResourceInitializationError`` ("Task failed to start") and a job that never got a
    start time or an exit code (cancelled while RUNNABLE) are NEVER_STARTED; a lost host
    ("Host EC2 (instance i-...) terminated.") is PREEMPTED when its compute environment is
    ``spot`` or Batch speaks of a spot interruption, else HOST_LOST; a container that
    exited with status 137 (SIGKILL) without ``OutOfMemoryError`` is KILLED (Batch names
    the OOM kills it sees: a plain 137 is a ``kill -9`` inside the container, an agent on
    its host, a TerminateJob's kill); every other end is EXITED.
    """
    container, attempt = _container(described)
    status_reason = described.get("statusReason") or ""
    said = "; ".join(r for r in (status_reason, container.get("reason") or attempt.get("reason")) if r)
    if described.get("status") == "SUCCEEDED":
        return EndReason.EXITED, said
    if status_reason and status_reason in (stop_reason, CLEAN_REASON):
        return EndReason.STOPPED, said
    if _OOM.search(said):
        resources = {r.get("type"): r.get("value") for r in container.get("resourceRequirements") or []}
        limit = resources.get("MEMORY") or container.get("memory") or memory
        return EndReason.OOM, said + (f" (memory limit {limit} MiB)" if limit else "")
    if _NOT_STARTED.search(said):
        return EndReason.NEVER_STARTED, said
    if _SPOT_WORDS.search(said):
        return EndReason.PREEMPTED, said
    if _HOST_LOST.search(said):
        return (EndReason.PREEMPTED if spot else EndReason.HOST_LOST), said
    if described.get("startedAt") is None or exit_status(described) is None:
        return EndReason.NEVER_STARTED, said
    if exit_status(described) == 128 + signal.SIGKILL:  # and Batch says no OutOfMemoryError
        return EndReason.KILLED, said or "the container was killed by SIGKILL, not for memory"
    return EndReason.EXITED, said


def final_code(described: Mapping[str, Any], stop_reason: str | None) -> int:
    """The exit code of a job Batch reports SUCCEEDED or FAILED: its container's (``-N`` after
    signal ``N``), else 0 for a success, ``-15`` when Fiber terminated it before its container
    ran (``stop_reason``), else 1."""
    status = exit_status(described)
    if status is not None:
        code = exitcode_from_status(status)
        return status if code is None else code
    if described.get("status") == "SUCCEEDED":
        return 0
    if stop_reason is not None:
        return -15  # terminated before its container ran
    return 1


def log_stream(described: Mapping[str, Any]) -> str | None:
    """The CloudWatch Logs stream of the job's container, once Batch names it."""
    container, attempt = _container(described)
    return container.get("logStreamName") or attempt.get("logStreamName")


def explain(job: Job) -> str:
    """A line saying why the job failed, as far as Batch and fiber know; ``""`` if it did not."""
    handle: BatchJob = job.handle
    if handle.note:
        return f"fiber-aws: {handle.note}"
    if not job.state.done() or handle.status != "FAILED":
        return ""
    where = f"AWS Batch job {job.id} ({handle.job_name}, queue {handle.queue})"
    if job.state.reason is EndReason.STOPPED:
        return f"fiber-aws: {where} was terminated by fiber: {job.state.detail}"
    if job.state.detail:
        return f"fiber-aws: {where} FAILED: {job.state.detail}"
    if job.state.reason is EndReason.NEVER_STARTED:
        return (f"fiber-aws: {where} FAILED before its container ran, and Batch gave no reason: "
                "check that the image exists where the compute environment pulls from and "
                "contains the job's command (python3)")
    return ""
