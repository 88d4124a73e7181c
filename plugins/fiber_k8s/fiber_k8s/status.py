"""What a pod's status means for its job: pure translations of the pod the watch saw into
the job's end (exit code, :class:`~fiber_core.contract.EndReason`, what the cluster said)."""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Any

from fiber_core.contract import HOST_LOST_EXITCODE, EndReason, exitcode_from_status

from fiber_k8s.spec import CONTAINER

NO_EXIT_STATUS = 1
"""Exit code of a job whose container left no exit status because it never ran."""
_FATAL_WAITING = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                  "CreateContainerConfigError", "CreateContainerError"}
"""Reasons a container waits that need a fix, not time: its job fails at once."""
_NOT_STARTED = {"StartError", "ContainerCannotRun"}
"""Reasons of a terminated container that never ran its command."""


def container_status(pod: Mapping[str, Any]) -> dict[str, Any]:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == CONTAINER:
            return cs
    return {}


def _said(reason: str | None, message: str | None) -> str:
    """``reason: message`` as the cluster gave them (either may be missing)."""
    return f"{reason or ''}: {message or ''}".strip(": ")


def pod_start_failure(pod: Mapping[str, Any]) -> str | None:
    """Why the pod's container cannot start without a fix (image pull, config), else ``None``."""
    waiting = (container_status(pod).get("state") or {}).get("waiting") or {}
    return _said(waiting["reason"], waiting.get("message")) if waiting.get("reason") in _FATAL_WAITING else None


def pod_unschedulable(pod: Mapping[str, Any] | None) -> str | None:
    """The scheduler's message while the pod has no node (``""`` if it gave none), else ``None``."""
    if pod and (pod.get("spec") or {}).get("nodeName"):
        return None
    for cond in ((pod or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return cond.get("message") or cond.get("reason") or ""
    return ""


def _exit_code(pod: Mapping[str, Any], deleted: bool, stop_signal: int | None) -> int | None:
    """The exit code of the job of ``pod`` (see :func:`pod_end`), ``None`` while it runs or waits."""
    status = pod.get("status") or {}
    state = container_status(pod).get("state") or {}
    term, phase, why = state.get("terminated") or {}, status.get("phase"), status.get("reason") or ""
    if term:
        code = exitcode_from_status(int(term.get("exitCode", 1))) or 0
    elif phase == "Unknown" or why == "NodeLost":  # its node stopped answering: the rest is stale
        code = HOST_LOST_EXITCODE
    elif "running" in state and not deleted:  # (an evicted pod's container is still being killed)
        return None
    elif phase == "Succeeded":
        code = 0
    elif phase == "Failed" or pod_start_failure(pod):
        code = NO_EXIT_STATUS
    elif deleted:  # gone without a final state: force-deleted, or deleted before it ran
        code = -(stop_signal or signal.SIGTERM)
    else:
        return None
    if stop_signal == signal.SIGKILL and code < 0:
        code = -signal.SIGKILL  # kill deletes the pod at once; a kubelet may still send SIGTERM first
    return code


def pod_end(pod: Mapping[str, Any], deleted: bool = False,
            stop_signal: int | None = None) -> tuple[int, EndReason, str] | None:
    """How the job of ``pod`` (its last state seen) ended: exit code, why, what the cluster said.

    ``None`` while it runs or waits for a node. ``deleted``: the pod is gone from the API;
    ``stop_signal``: Fiber deleted it to stop the job (SIGTERM, or SIGKILL for a kill). A
    container ended by signal N (status 128+N) gives ``-N``, as multiprocessing does; a job
    whose container left no exit status has code 1 (:data:`HOST_LOST_EXITCODE` when its node
    was lost). Why, in this order: the container's
    ``OOMKilled``; Fiber's own stop; a ``DisruptionTarget`` condition (preemption, the eviction
    API, the taint manager, the kubelet; ``DeletionByPodGC``: its node is gone) or
    ``reason: Evicted``; a lost node (``NodeLost``, phase ``Unknown``); a pod that never ran
    its command; a pod deleted by someone else; a container ended by SIGKILL (status 137)
    with reason ``Error``, not ``OOMKilled`` (KILLED: a ``kill -9`` inside it, an agent on its
    node); else the program's own exit.
    """
    status, name = pod.get("status") or {}, (pod.get("metadata") or {}).get("name", "")
    state = container_status(pod).get("state") or {}
    term, phase, why = state.get("terminated") or {}, status.get("phase"), status.get("reason") or ""
    start_failure = pod_start_failure(pod)
    code = _exit_code(pod, deleted, stop_signal)
    if code is None:
        return None

    if term.get("reason") == "OOMKilled":
        limit = next((((c.get("resources") or {}).get("limits") or {}).get("memory")
                      for c in (pod.get("spec") or {}).get("containers") or [] if c.get("name") == CONTAINER), None)
        return -signal.SIGKILL, EndReason.OOM, (
            f"the container was killed for exceeding its memory limit of {limit} (OOMKilled)" if limit
            else "the container was killed by its node's out-of-memory killer (OOMKilled)")
    if stop_signal is not None and code < 0:
        return code, EndReason.STOPPED, ""
    disruption = next((c for c in status.get("conditions") or []
                       if c.get("type") == "DisruptionTarget" and c.get("status") == "True"), None)
    if disruption is not None or why == "Evicted":
        cause = disruption or {"reason": why, "message": status.get("message")}
        said = _said(cause.get("reason"), cause.get("message"))
        if cause.get("reason") == "DeletionByPodGC":  # its node no longer exists
            return code, EndReason.HOST_LOST, f"pod {name} was lost with its node ({said})"
        return code, EndReason.PREEMPTED, f"pod {name} was {'evicted' if why == 'Evicted' else 'disrupted'} ({said})"
    if phase == "Unknown" or why == "NodeLost":
        return code, EndReason.HOST_LOST, f"the node of pod {name} was lost ({_said(why, status.get('message'))})"
    if start_failure or term.get("reason") in _NOT_STARTED or (phase == "Failed" and not term):
        said = start_failure or _said(term.get("reason") or why, term.get("message") or status.get("message"))
        return code, EndReason.NEVER_STARTED, f"pod {name} could not start: {said}"
    if deleted or (pod.get("metadata") or {}).get("deletionTimestamp"):
        if term or "running" in state:
            return code, EndReason.HOST_LOST, f"pod {name} was deleted by someone other than Fiber"
        return code, EndReason.NEVER_STARTED, f"pod {name} was deleted by someone other than Fiber before it ran"
    if term.get("reason") == "Error" and code == -signal.SIGKILL:  # the runtime says: not OOMKilled
        return code, EndReason.KILLED, f"the container of pod {name} was killed by SIGKILL, not for memory (Error)"
    if term.get("reason") not in (None, "", "Completed", "Error"):
        return code, EndReason.EXITED, _said(f"container {term['reason']}", term.get("message"))
    return code, EndReason.EXITED, ""
