"""The poller of the ``aws-batch`` backend: one :class:`~fiber_core.contract.Watcher` that keeps
the status of every unfinished job of a backend with batched ``DescribeJobs`` calls, and
finishes each job's state when Batch reports its end (:mod:`fiber_aws.status` says how)."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from fiber_core.contract import (
    HOST_LOST_EXITCODE,
    BackendError,
    EndReason,
    Job,
    Watcher,
    waiting_verdict,
)

from fiber_aws.api import AwsError, call, list_jobs
from fiber_aws.spec import run_part
from fiber_aws.status import (
    FINAL,
    QUEUED,
    BatchJob,
    end_reason,
    exit_status,
    explain,
    final_code,
    log_stream,
)

if TYPE_CHECKING:
    from fiber_aws.backend import AwsBatchBackend

log = logging.getLogger("fiber")

_MAX_BACKOFF = 30.0
_LOST_AFTER = 3  # DescribeJobs rounds without the job before it counts as lost...
_LOST_GRACE = 60.0  # ...and seconds after submission (new jobs may not be visible at once)
_SPOT_ENVIRONMENTS = ("SPOT", "FARGATE_SPOT")


class Poller:
    """Asks Batch about a backend's unfinished jobs, up to ``describe_batch`` ids a call, while
    it has any (its live jobs, and those cleanup terminated until Batch reports their ends)."""

    def __init__(self, backend: AwsBatchBackend) -> None:
        self.backend = backend
        self.lock = threading.Lock()
        self.stopping: list[Job] = []
        self._watcher: Watcher | None = None
        self._errors_shown: set[str] = set()
        self._spot: dict[str, bool] = {}

    def follow_stopping(self, jobs: list[Job]) -> None:
        """Keep asking about ``jobs``, which cleanup took from the live-job table."""
        with self.lock:
            self.stopping += jobs

    def ensure(self) -> None:
        """Start the watcher if a job is unfinished and none runs."""
        b = self.backend
        with self.lock:
            if (b.jobs or self.stopping) and (self._watcher is None or self._watcher.stopped):
                self._watcher = b.watch(self._poll, f"poller-{b.run_id}", b.settings["poll_interval"], _MAX_BACKOFF)

    def wake(self) -> None:
        """Ask at once (a job was terminated)."""
        with self.lock:
            if self._watcher is not None:
                self._watcher.wake()

    def _poll(self) -> None:
        """One round: refresh every unfinished job; when none is left, the watcher stops."""
        with self.lock:
            self.stopping = [job for job in self.stopping if not job.state.done()]
            pending = self.backend.jobs + self.stopping
            if not pending:
                if self._watcher is not None:
                    self._watcher.stop()
                    self._watcher = None
                return
        try:
            self._refresh(pending)
        except AwsError as e:
            if not e.throttled and str(e) not in self._errors_shown:
                self._errors_shown.add(str(e))
                log.warning("fiber: cannot read the status of AWS Batch jobs (retrying): %s", e)
            raise
        except Exception:
            log.exception("fiber: the AWS Batch poller failed (retrying)")
            raise

    def _refresh(self, pending: list[Job]) -> None:
        b = self.backend
        for i in range(0, len(pending), b.describe_batch):
            chunk = pending[i:i + b.describe_batch]
            described = {d["jobId"]: d for d in call(b.batch, "describe_jobs", jobs=[job.id for job in chunk])["jobs"]}
            for job in chunk:
                handle: BatchJob = job.handle
                d = described.get(job.id)
                if d is not None:
                    handle.described, handle.missing = d, 0
                    handle.log_stream = log_stream(d) or handle.log_stream
                    continue
                handle.missing += 1
                if handle.missing >= _LOST_AFTER and time.monotonic() - handle.submitted > _LOST_GRACE:
                    handle.note = (f"AWS Batch no longer knows job {job.id} ({handle.job_name}, "
                                   f"queue {handle.queue}): it was deleted or expired")
                    job.state.finish(HOST_LOST_EXITCODE, EndReason.HOST_LOST, handle.note)
        finished = [job for job in pending if job.handle.status in FINAL and not job.state.done()]
        without_code = [job for job in finished if exit_status(job.handle.described) is None
                        and job.handle.described.get("startedAt") is not None]
        if without_code:
            self._fill_exit_status(without_code)
        for job in finished:
            self._finish(job)
        self._check_queued(pending)

    def _finish(self, job: Job) -> None:
        """Finish the state of a job that Batch reports SUCCEEDED or FAILED."""
        handle: BatchJob = job.handle
        failed = handle.status == "FAILED"
        reason, said = end_reason(handle.described, stop_reason=handle.stop_reason, memory=handle.memory,
                                  spot=failed and self.queue_is_spot(handle.queue))
        first = job.state.finish(final_code(handle.described, handle.stop_reason), reason, said)
        if first and failed and said and reason is not EndReason.STOPPED:
            log.warning("fiber: %s", explain(job).removeprefix("fiber-aws: "))

    def queue_is_spot(self, queue: str) -> bool:
        """Whether a compute environment of ``queue`` runs on Spot capacity (asked once per queue)."""
        with self.lock:
            known = self._spot.get(queue)
        if known is None:
            try:
                known = any((ce.get("computeResources") or {}).get("type") in _SPOT_ENVIRONMENTS
                            for ce in self.backend.environments([queue]))
            except AwsError as e:
                log.debug("fiber: cannot tell whether queue %s runs on Spot capacity: %s", queue, e)
                known = False
            with self.lock:
                self._spot[queue] = known
        return known

    def _fill_exit_status(self, jobs: list[Job]) -> None:
        # Some Batch implementations (moto) leave container.exitCode out of DescribeJobs; the job
        # summaries of ListJobs carry it too. One call per queue, only when needed.
        by_id: dict[str, BatchJob] = {job.id: job.handle for job in jobs}
        prefix = f"fiber-{run_part(self.backend.run_id)}-"
        for queue in {handle.queue for handle in by_id.values()}:
            for summary in list_jobs(self.backend.batch, queue, prefix):
                handle = by_id.get(summary["jobId"])
                status = (summary.get("container") or {}).get("exitCode")
                if handle is not None and status is not None:
                    handle.described.setdefault("container", {})["exitCode"] = int(status)

    def _check_queued(self, pending: list[Job]) -> None:
        b = self.backend
        limit = b.settings["runnable_timeout"]
        now = time.monotonic()
        for job in pending:
            handle: BatchJob = job.handle
            if handle.status not in QUEUED or job.state.done():
                continue
            verdict = waiting_verdict(handle.choice, len(job.spec.alternatives), now - handle.submitted,
                                      b.settings["fallback_wait"], limit or 0)
            if verdict == "next":
                if handle.stop_reason is None:  # not one being stopped
                    b.next_choice(job)
                continue
            if verdict != "fail":
                continue
            reason = f"fiber: no capacity within runnable_timeout={limit:g}s on queue {handle.queue} (run {b.run_id})"
            handle.note = (
                f"AWS Batch job {job.id} ({handle.job_name}) waited more than {limit:g}s in "
                f"{handle.status} on queue {handle.queue} without starting: its compute environments "
                "have no capacity for it (no instance type with its vCPUs, memory or GPUs, maxvCpus "
                "reached, or an EC2 quota). Check the queue's compute environments, or raise "
                f"[aws] runnable_timeout (FIBER_AWS_RUNNABLE_TIMEOUT; 0 waits forever)"
            )
            log.warning("fiber: %s", handle.note)
            try:
                b.terminate(job, reason)
            except BackendError as e:
                log.warning("fiber: %s", e)
            job.state.finish(1, EndReason.NEVER_STARTED, handle.note)


__all__ = ["Poller"]
