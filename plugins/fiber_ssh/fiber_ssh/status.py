"""Why a job on an SSH host ended: a pure translation of what its supervisor reported and what
became of its channel and connection into the exit code and :class:`~fiber_core.contract.EndReason`."""

from __future__ import annotations

from dataclasses import dataclass

from fiber_core.contract import HOST_LOST_EXITCODE, EndReason, exitcode_from_status


@dataclass
class Seen:
    """What the backend saw of one job's end, as :func:`job_end` reads it."""

    host: str
    """The host's name, for messages."""
    reported: int | None = None
    """The exit code the supervisor reported."""
    error: str = ""
    """Why the supervisor could not start the job."""
    oom: bool = False
    """The supervisor saw the kernel's OOM killer end the job."""
    killed: bool = False
    """The supervisor saw a SIGKILL it did not send end the job while the kernel's count of
    OOM kills in its memory cgroup stood still: not an OOM kill."""
    started: bool = False
    """The supervisor said the job runs (its process group)."""
    stop_requested: bool = False
    closing: bool = False
    """cleanup() closed the channel."""
    connected: bool = True
    """The connection to the host is still up."""
    broke: str = "closed"
    """What broke the connection, when it is down."""
    exit_status: int | None = None
    """The supervisor's own exit status on the channel (``None`` or negative: none came)."""
    spot: bool = False
    """The host is labelled ``capacity=spot``: its loss is a preemption."""


def job_end(seen: Seen) -> tuple[int, EndReason | None, str]:
    """(exit code, why, what to say) of a job; ``None`` for why: its own exit, or STOPPED when
    Fiber asked. A lost host is :data:`~fiber_core.contract.HOST_LOST_EXITCODE`, ``HOST_LOST``
    (``PREEMPTED`` for a host labelled ``capacity=spot``)."""
    host = seen.host
    if seen.reported is not None:
        if seen.error:
            return seen.reported, EndReason.NEVER_STARTED, f"{host}: {seen.error}"
        if seen.oom and not seen.stop_requested:
            return seen.reported, EndReason.OOM, f"the kernel's out-of-memory killer ended the job on {host}"
        if seen.killed and not seen.stop_requested:
            return seen.reported, EndReason.KILLED, (f"the job on {host} was killed by SIGKILL, not by the "
                                                     "out-of-memory killer (its cgroup counted none)")
        return seen.reported, None, ""
    if seen.closing:
        return HOST_LOST_EXITCODE, EndReason.STOPPED, f"the connection to {host} was closed by cleanup()"
    lost = EndReason.PREEMPTED if seen.spot else EndReason.HOST_LOST  # a spot machine taken back
    kind = "spot host " if seen.spot else ""
    if not seen.connected:
        return HOST_LOST_EXITCODE, lost, f"lost {kind}{host}: the connection broke ({seen.broke})"
    if seen.exit_status is not None and seen.exit_status >= 0:
        code = exitcode_from_status(seen.exit_status) or 0
        reason = None if seen.started else EndReason.NEVER_STARTED  # it never said that the job runs
        return code, reason, f"the job supervisor on {host} exited with status {code}"
    return HOST_LOST_EXITCODE, lost, f"the channel to {kind}{host} closed without an exit status"
