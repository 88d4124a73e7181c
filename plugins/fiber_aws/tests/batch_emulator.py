"""moto's server with AWS Batch's job retries, and a switch that loses the host of a running job.

``python batch_emulator.py -H 127.0.0.1 -p PORT`` serves moto (``moto.server``) unchanged,
except for what fiber-aws relies on and moto 5 leaves out:

- **Retries.** moto stores a ``retryStrategy`` and never acts on it: a failed job is FAILED
  at once. Here, as AWS Batch documents it (User Guide, "Automated job retries"), a job
  whose attempt failed runs again while it has attempts left (``attempts``, 1 to 10; the
  SubmitJob strategy over its job definition's) and the first ``evaluateOnExit`` rule whose
  conditions all match (``onStatusReason``, ``onReason``, ``onExitCode``: the whole value, or
  its start where the pattern ends with ``*``) says RETRY; with no rule matching it is
  retried too. A job stopped by TerminateJob is not retried. Each attempt is in the job's
  ``attempts`` with its ``statusReason`` and exit code; the job goes back to the queue
  (through SUBMITTED, where AWS goes to RUNNABLE) and ``AWS_BATCH_JOB_ATTEMPT`` tells the
  container which attempt it is.
- **Which emulator.** ``GET /fiber-emulator/revision`` answers ``{"revision": ...}``, a digest
  of this file, so that a test uses the shared service only when it runs this code.
- **A lost host.** ``POST /fiber-emulator/lose-host`` with ``{"jobId": ID}`` does to a
  running job what the loss of its EC2 instance (or a Spot reclaim) does on AWS: its
  container is killed, and the attempt ends FAILED with the statusReason ``Host EC2
  (instance i-...) terminated.`` and no exit code; then the retry strategy applies. moto has
  no instances to lose: without this, nothing in a test could end an attempt that way.
- **The job role's credentials.** A container whose job definition names a ``jobRoleArn``
  gets credentials in its environment, as ECS gives a task its role's (moto accepts any);
  DescribeJobs does not show them. Without them, a job that calls AWS itself (``fiber run``'s
  program, submitting its processes' jobs) has none.
- **The execution role's secrets.** moto runs a container without the ``secrets`` of its
  job definition; here each comes from moto's SSM Parameter Store into the container's
  environment, as the ECS agent does with the execution role (a parameter that is missing
  fails the attempt before its container runs, as on AWS), and DescribeJobs shows none.

``scripts/services/moto.sh`` starts the shared service with it; a test may start one of its
own the same way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from moto.batch import models, responses

LOSE_HOST = "/fiber-emulator/lose-host"
REVISION = "/fiber-emulator/revision"
ROLE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "job-role", "AWS_SECRET_ACCESS_KEY": "job-role"}
"""What a job with a role finds in its environment (moto checks no signature)."""
CONTAINER_EXITED = "Essential container in task exited"
"""The statusReason AWS Batch gives an attempt whose container ended by itself."""

_submitting = threading.local()  # the retryStrategy of the SubmitJob this thread is answering


def matches(pattern: str | None, value: str) -> bool:
    """Whether an ``evaluateOnExit`` condition holds: no pattern, the whole value, or its start (``abc*``)."""
    if pattern is None:
        return True
    return value.startswith(pattern[:-1]) if pattern.endswith("*") else value == pattern


def retried(strategy: Mapping[str, Any] | None, attempt: int, status_reason: str, reason: str,
            exit_code: int | None) -> bool:
    """Whether AWS Batch runs a job again after its attempt number ``attempt`` (from 1) failed."""
    if not strategy or attempt >= int(strategy.get("attempts") or 1):
        return False
    code = "" if exit_code is None else str(exit_code)
    for rule in strategy.get("evaluateOnExit") or []:
        if (matches(rule.get("onStatusReason"), status_reason) and matches(rule.get("onReason"), reason)
                and matches(rule.get("onExitCode"), code)):
            return str(rule.get("action", "")).upper() == "RETRY"
    return True


class RetryingJob(models.Job):
    """moto's Batch job, run once per attempt while its retry strategy says so."""

    __module__ = "moto.batch.models"  # moto's model class keeps its instances by the service it names

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.retry_strategy = getattr(_submitting, "strategy", None) or self.job_definition.retry_strategy
        self.lost_host: str | None = None
        self._attempt_over = False
        self._attempt_success = False

    def run(self) -> None:
        while True:
            self._attempt_over = False
            super().run()  # one attempt: a container, until it ends
            success, attempt = self._attempt_success, self.latest_attempt
            exit_code = None if self.lost_host else self.exit_code
            # No exit code and no lost host: the container never ran (moto could not start it),
            # for which moto, like this emulator, gives no reason.
            ran = exit_code is not None or bool(self.lost_host)
            status_reason = self.lost_host or self.job_stopped_reason or (CONTAINER_EXITED if ran else "")
            if attempt is not None:
                if status_reason:
                    attempt["statusReason"] = status_reason
                attempt["stoppedAt"] = models.datetime2int_milliseconds(datetime.now())
                attempt["container"]["logStreamName"] = self.log_stream_name
                if exit_code is not None:
                    attempt["container"]["exitCode"] = exit_code
            if (not success and not self.stop
                    and retried(self.retry_strategy, len(self.attempts), status_reason, "", exit_code)):
                self._again()
                continue
            self.exit_code = exit_code
            self.job_stopped_reason = None if success else (status_reason or None)
            super()._mark_stopped(success)
            return

    def _again(self) -> None:
        """Back to the queue for the next attempt."""
        self.lost_host = None
        self.exit_code = None
        self.job_stopped_reason = None
        self.latest_attempt = None
        self.status = models.JobStatus.SUBMITTED.value
        self._tick = 0

    def _mark_stopped(self, success: bool = True) -> None:
        """The end of an attempt (moto's run() calls it, maybe twice); :meth:`run` decides what follows."""
        if not self._attempt_over:
            self._attempt_over, self._attempt_success = True, success

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        if self.retry_strategy:
            out["retryStrategy"] = self.retry_strategy
        return out

    def _get_container_property(self, p: str, default: Any) -> Any:
        value = super()._get_container_property(p, default)
        if p != "environment" or threading.current_thread() is not self:
            return value  # (DescribeJobs, in a request's thread, shows the job's own variables only)
        properties = self.job_definition.container_properties or {}
        extra = {"AWS_BATCH_JOB_ATTEMPT": str(len(self.attempts) + 1)}
        if properties.get("jobRoleArn"):
            extra.update(ROLE_CREDENTIALS)
        for secret in properties.get("secrets") or []:
            extra[secret["name"]] = self._parameter(secret["valueFrom"])
        return [e for e in value if e["name"] not in extra] + [{"name": k, "value": v} for k, v in extra.items()]

    def _parameter(self, name: str) -> str:
        """The value of the SSM parameter ``name`` (or ARN), as the execution role reads it."""
        from moto.ssm.models import ssm_backends

        found = ssm_backends[self.backend.account_id][self.backend.region_name].get_parameter(name)
        if found is None:  # moto's run() fails the attempt, and says why in its log
            raise LookupError(f"ResourceInitializationError: unable to retrieve secret from ssm: {name}")
        return found.decrypt(found.value) or ""

    def lose_host(self) -> str:
        """End the running attempt as the loss of its instance does; the statusReason given."""
        reason = f"Host EC2 (instance i-{secrets.token_hex(8)}) terminated."
        container = self.docker_client.containers.get(f"{self.job_name}-{self.job_id.replace(':', '-')}")
        self.lost_host = reason
        container.kill()
        return reason


def _submit_job(original: Callable[[Any], str]) -> Callable[[Any], str]:
    def submitjob(self: Any) -> str:
        _submitting.strategy = self._get_param("retryStrategy")
        try:
            return original(self)
        finally:
            _submitting.strategy = None

    return submitjob


def _jobs() -> Iterable[models.Job]:
    for regions in models.batch_backends.values():
        for backend in regions.values():
            yield from backend._jobs.values()


def lose_host(job_id: str) -> tuple[str, dict[str, Any]]:
    """The answer to ``POST /fiber-emulator/lose-host``: HTTP status and body."""
    job = next((j for j in _jobs() if j.job_id == job_id), None)
    if not isinstance(job, RetryingJob):
        return "404 Not Found", {"error": f"no job {job_id!r}"}
    if job.status != models.JobStatus.RUNNING.value:
        return "409 Conflict", {"error": f"job {job_id} is {job.status}, not RUNNING: it has no host to lose"}
    try:
        return "200 OK", {"statusReason": job.lose_host()}
    except Exception as e:  # the container is gone already (docker's NotFound): nothing to lose
        return "409 Conflict", {"error": f"job {job_id} has no running container: {e}"}


class Admin:
    """WSGI: ``POST /fiber-emulator/lose-host``, else moto."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get("PATH_INFO") == REVISION:
            start_response("200 OK", [("Content-Type", "application/json")])
            return [json.dumps({"revision": revision()}).encode()]
        if environ.get("PATH_INFO") != LOSE_HOST or environ.get("REQUEST_METHOD") != "POST":
            return self.app(environ, start_response)
        size = int(environ.get("CONTENT_LENGTH") or 0)
        try:
            body = json.loads(environ["wsgi.input"].read(size) or b"{}")
            status, answer = lose_host(str(body["jobId"]))
        except (ValueError, KeyError, TypeError):
            status, answer = "400 Bad Request", {"error": 'expected {"jobId": ID}'}
        start_response(status, [("Content-Type", "application/json")])
        return [json.dumps(answer).encode()]


def revision() -> str:
    """A digest of this file: what the emulator that runs it answers at ``/fiber-emulator/revision``."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def install() -> None:
    """Put the retrying job in moto's Batch (SubmitJob makes its jobs from ``models.Job``)."""
    models.Job = RetryingJob  # type: ignore[misc]
    responses.BatchResponse.submitjob = _submit_job(responses.BatchResponse.submitjob)  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import run_simple

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("MOTO_PORT", str(args.port))  # moto tells its Batch containers where it is
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    install()
    run_simple(args.host, args.port, Admin(DomainDispatcherApplication(create_backend_app)), threaded=True,
               request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
