"""What a pod's status means for its job, as fiber_k8s.status reads it: pure, no cluster."""

from __future__ import annotations

from typing import Any

import pytest
from fiber_core.contract import HOST_LOST_EXITCODE, EndReason

from fiber_k8s.status import pod_end


def pod_status(**status: Any) -> dict[str, Any]:
    """A pod object as the API server returns it, with ``status``."""
    return {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "job"}]}, "status": status}


RUNNING = [{"name": "job", "state": {"running": {"startedAt": "2024-01-01T00:00:00Z"}}}]


@pytest.mark.parametrize("pod, deleted, end", [
    # Pod objects that this emulator does not produce, as a cluster does.
    (pod_status(phase="Unknown", reason="NodeLost", message="Node n which was running pod p is unresponsive",
                containerStatuses=RUNNING), False, (HOST_LOST_EXITCODE, EndReason.HOST_LOST, "NodeLost")),
    (pod_status(phase="Running", containerStatuses=RUNNING, conditions=[{
        "type": "DisruptionTarget", "status": "True", "reason": "DeletionByPodGC",
        "message": "PodGC: node no longer exists"}]), True, (-15, EndReason.HOST_LOST, "DeletionByPodGC")),
    (pod_status(phase="Running", containerStatuses=RUNNING, conditions=[{
        "type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler",
        "message": "default-scheduler: preempting to accommodate a higher priority pod"}]), True,
     (-15, EndReason.PREEMPTED, "PreemptionByScheduler")),
    (pod_status(phase="Running", containerStatuses=RUNNING), False, None),
    (pod_status(phase="Pending"), False, None),  # waiting for a node
    # The ends the emulator produces too, here without a cluster.
    (pod_status(phase="Succeeded", containerStatuses=[{"name": "job", "state": {"terminated": {
        "exitCode": 0, "reason": "Completed"}}}]), False, (0, EndReason.EXITED, "")),
    (pod_status(phase="Failed", containerStatuses=[{"name": "job", "state": {"terminated": {
        "exitCode": 137, "reason": "OOMKilled"}}}]), False, (-9, EndReason.OOM, "OOMKilled")),
    (pod_status(phase="Failed", containerStatuses=[{"name": "job", "state": {"terminated": {
        "exitCode": 137, "reason": "Error"}}}]), False, (-9, EndReason.KILLED, "not for memory")),
    (pod_status(phase="Failed", containerStatuses=[{"name": "job", "state": {"terminated": {
        "exitCode": 1, "reason": "Error"}}}]), False, (1, EndReason.EXITED, "")),
    (pod_status(phase="Failed", containerStatuses=[{"name": "job", "state": {"terminated": {
        "exitCode": 137, "reason": "ContainerStatusUnknown"}}}]), False, (-9, EndReason.EXITED, "")),
    (pod_status(phase="Pending", containerStatuses=[{"name": "job", "state": {"waiting": {
        "reason": "ErrImagePull", "message": "no such image"}}}]), False,
     (1, EndReason.NEVER_STARTED, "ErrImagePull: no such image")),
    (pod_status(phase="Pending"), True, (-15, EndReason.NEVER_STARTED, "before it ran")),
])
def test_pod_end_as_a_cluster_reports_it(pod: dict[str, Any], deleted: bool, end: tuple | None) -> None:
    got = pod_end(pod, deleted)
    if end is None:
        assert got is None
    else:
        assert got is not None and got[:2] == end[:2] and end[2] in got[2]


def test_a_pod_fiber_deleted_ended_stopped_with_the_signal_it_was_sent() -> None:
    running = pod_status(phase="Running", containerStatuses=RUNNING)
    assert pod_end(running, True, 15) == (-15, EndReason.STOPPED, "")
    assert pod_end(running, True, 9) == (-9, EndReason.STOPPED, "")  # a kill, whatever the kubelet sent first
