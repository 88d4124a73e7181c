"""Why a Batch job ended: :func:`fiber_aws.status.end_reason` on DescribeJobs entries as AWS Batch gives them.

The moto tests (``test_aws_batch.py``) cover the ends moto can produce or report:
Fiber's TerminateJob (STOPPED), someone else's (KILLED: moto kills at once), an image whose command
cannot start (NEVER_STARTED), no capacity within ``runnable_timeout`` (NEVER_STARTED),
a lost host's and a Spot interruption's statusReason (HOST_LOST, PREEMPTED).
The cases here are those moto cannot express, so the mapping is tested on the
shapes AWS Batch returns (the ``JobDetail`` of the DescribeJobs API, trimmed of
fields the mapping does not read):

* moto never sets a container's ``reason``: no ``OutOfMemoryError`` (it does not
  even give the container a memory limit), no ``CannotPullContainerError``,
  ``CannotStartContainerError`` or ``ResourceInitializationError``; a container that
  cannot start is a FAILED job with no reason at all.
* moto runs the container of a job cancelled while it waited (CancelJob in
  SUBMITTED/RUNNABLE), and reports a ``startedAt`` and an exit code for every
  FAILED job, so a job that never left RUNNABLE cannot be seen there.
"""

from __future__ import annotations

from typing import Any

import pytest
from fiber_core.contract import EndReason

from fiber_aws.status import CLEAN_REASON, end_reason

JOB_ID = "2b7a4cbb-0d7e-4f0a-9a46-0c1c3e6f9a11"
STREAM = f"fiber-0a1b2c3d4e5f6789/default/{JOB_ID}"
T0 = 1_718_000_000_000


def job(status: str, status_reason: str | None = None, *, exit_code: int | None = None,
        container_reason: str | None = None, started: bool = True, memory: str = "2048") -> dict[str, Any]:
    """A DescribeJobs ``jobs[]`` entry of a container job, with one attempt if it started."""
    container: dict[str, Any] = {
        "image": "123456789012.dkr.ecr.us-east-1.amazonaws.com/app:1",
        "command": ["python3", "-m", "fiber_core.processes.worker"],
        "resourceRequirements": [{"value": "1", "type": "VCPU"}, {"value": memory, "type": "MEMORY"}],
    }
    attempt_container: dict[str, Any] = {
        "containerInstanceArn": "arn:aws:ecs:us-east-1:123456789012:container-instance/fiber/5f1e",
        "taskArn": "arn:aws:ecs:us-east-1:123456789012:task/fiber/9c2d",
        "networkInterfaces": [],
    }
    for c in (container, attempt_container):
        if exit_code is not None:
            c["exitCode"] = exit_code
        if container_reason is not None:
            c["reason"] = container_reason
        if started:
            c["logStreamName"] = STREAM
    d: dict[str, Any] = {
        "jobArn": f"arn:aws:batch:us-east-1:123456789012:job/{JOB_ID}",
        "jobName": "fiber-r1-1-Process-1",
        "jobId": JOB_ID,
        "jobQueue": "arn:aws:batch:us-east-1:123456789012:job-queue/fiber-cpu",
        "status": status,
        "createdAt": T0,
        "stoppedAt": T0 + 60_000,
        "container": container,
        "attempts": [],
    }
    if status_reason is not None:
        d["statusReason"] = status_reason
    if started:
        d["startedAt"] = T0 + 30_000
        attempt = {"container": attempt_container, "startedAt": T0 + 30_000, "stoppedAt": T0 + 60_000}
        if status_reason is not None:
            attempt["statusReason"] = status_reason
        d["attempts"] = [attempt]
    return d


OOM = "OutOfMemoryError: Container killed due to memory usage"
HOST_LOSS = "Host EC2 (instance i-0a1b2c3d4e5f60718) terminated."


def test_out_of_memory_is_oom_with_the_jobs_memory() -> None:
    reason, said = end_reason(job("FAILED", "Essential container in task exited", exit_code=137,
                                  container_reason=OOM, memory="3072"))
    assert reason is EndReason.OOM
    assert said == f"Essential container in task exited; {OOM} (memory limit 3072 MiB)"


def test_out_of_memory_without_resource_requirements_names_the_submitted_memory() -> None:
    d = job("FAILED", "Essential container in task exited", exit_code=137, container_reason=OOM)
    del d["container"]["resourceRequirements"]
    assert end_reason(d, memory=1024) == (
        EndReason.OOM, f"Essential container in task exited; {OOM} (memory limit 1024 MiB)")


@pytest.mark.parametrize("container_reason", [
    "CannotPullContainerError: Error response from daemon: pull access denied for app, repository "
    "does not exist or may require 'docker login': denied: requested access to the resource is denied",
    "CannotStartContainerError: Error response from daemon: failed to create shim task: OCI runtime "
    "create failed: runc create failed: unable to start container process: exec: \"python3\": "
    "executable file not found in $PATH: unknown",
    "ResourceInitializationError: unable to pull secrets or registry auth: execution resource "
    "retrieval failed: unable to retrieve ecr registry auth: service call has been retried 3 time(s)",
])
def test_container_that_could_not_start_never_started(container_reason: str) -> None:
    reason, said = end_reason(job("FAILED", "Task failed to start", container_reason=container_reason))
    assert reason is EndReason.NEVER_STARTED
    assert said == f"Task failed to start; {container_reason}"


def test_job_cancelled_while_runnable_never_started() -> None:
    d = job("FAILED", "cancelled by operator", started=False)
    assert end_reason(d) == (EndReason.NEVER_STARTED, "cancelled by operator")


def test_job_cancelled_by_fiber_while_runnable_was_stopped() -> None:
    fiber = "fiber: terminated by its parent (run r1)"
    assert end_reason(job("FAILED", fiber, started=False), stop_reason=fiber) == (EndReason.STOPPED, fiber)


@pytest.mark.parametrize(("spot", "reason"), [(False, EndReason.HOST_LOST), (True, EndReason.PREEMPTED)])
def test_lost_host_is_preempted_only_on_spot_capacity(spot: bool, reason: EndReason) -> None:
    # A lost host often leaves no exit code (or 143); either way the reason decides.
    assert end_reason(job("FAILED", HOST_LOSS), spot=spot) == (reason, HOST_LOSS)
    assert end_reason(job("FAILED", HOST_LOSS, exit_code=143), spot=spot) == (reason, HOST_LOSS)


def test_spot_interruption_is_preempted_whatever_the_queue() -> None:
    said = "Your Spot Task was interrupted."
    assert end_reason(job("FAILED", said, exit_code=143)) == (EndReason.PREEMPTED, said)


def test_fibers_own_stops_are_stopped() -> None:
    fiber = "fiber: the parent process exited (run r1)"
    assert end_reason(job("FAILED", fiber, exit_code=143), stop_reason=fiber)[0] is EndReason.STOPPED
    assert end_reason(job("FAILED", CLEAN_REASON, exit_code=143))[0] is EndReason.STOPPED
    # Fiber's reason only counts when Fiber gave it to this job.
    assert end_reason(job("FAILED", fiber, exit_code=143))[0] is EndReason.EXITED


@pytest.mark.parametrize(("d", "said"), [
    (job("SUCCEEDED", "Essential container in task exited", exit_code=0), "Essential container in task exited"),
    (job("FAILED", "Essential container in task exited", exit_code=3), "Essential container in task exited"),
    (job("FAILED", exit_code=1), ""),
])
def test_the_programs_own_exit_is_exited(d: dict[str, Any], said: str) -> None:
    assert end_reason(d) == (EndReason.EXITED, said)


def test_a_sigkill_batch_does_not_call_out_of_memory_is_killed() -> None:
    said = "Essential container in task exited"
    assert end_reason(job("FAILED", said, exit_code=137)) == (EndReason.KILLED, said)
    assert end_reason(job("FAILED", exit_code=137))[0] is EndReason.KILLED
    # With Batch's OutOfMemoryError the same status is the OOM kill.
    assert end_reason(job("FAILED", said, exit_code=137, container_reason=OOM))[0] is EndReason.OOM


def test_container_that_never_exited_without_a_reason_never_started() -> None:
    # What moto reports for an image without the command: FAILED, started, no exit code.
    assert end_reason(job("FAILED")) == (EndReason.NEVER_STARTED, "")


def test_the_exit_code_is_the_containers_else_what_the_end_says() -> None:
    from fiber_aws.status import final_code

    assert final_code({"status": "FAILED", "container": {"exitCode": 137}}, None) == -9
    assert final_code({"status": "FAILED", "container": {"exitCode": 3}}, None) == 3
    assert final_code({"status": "SUCCEEDED"}, None) == 0
    assert final_code({"status": "FAILED"}, "fiber: terminated") == -15  # before its container ran
    assert final_code({"status": "FAILED"}, None) == 1
