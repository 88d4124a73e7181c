"""``fiber run --backend aws-batch --durable``: the program's Batch job, retried when its host is lost.

AWS Batch retries a job by its ``retryStrategy``: ``attempts`` (1 to 10: AWS's limit, and
every attempt counts, whatever ended it) and ``evaluateOnExit``, rules tried in order whose
first match says RETRY or EXIT (none matching: RETRY). A lost instance, on-demand or Spot
(reclaimed), ends an attempt with the statusReason ``Host EC2 (instance i-...) terminated.``:
that is retried; the program's own failure ends the job, unless ``--retries`` lets Batch run
it again. Each start is a new run of the program: with a journal in S3 (``FIBER_JOURNAL =
s3://bucket/prefix``) it picks up where the last one was.

The retry strategy and what ``fiber run`` says are decided by pure functions here;
:func:`follow` is the I/O: it copies the job's log until the job ends.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from fiber_aws.api import AwsError, call
from fiber_aws.status import FINAL, final_code

MAX_ATTEMPTS = 10
"""The most attempts AWS Batch gives a job (``retryStrategy.attempts``)."""

JOURNAL_WAIT = 60.0
"""Seconds a start waits for the journal's lease (``journal_wait``; ``--env`` overrides it): a
master lost with its host could not give the lease back, and it expires 15 s after its last
renewal."""

HOST_LOST = {"onStatusReason": "Host EC2*", "action": "RETRY"}
"""The rule that retries an attempt whose instance went away (terminated, or a Spot instance reclaimed)."""


def retry_strategy(retries: int) -> dict[str, Any]:
    """The ``retryStrategy`` of the program's job: a lost host is retried while attempts remain;
    a failure of the program itself ends the job (``retries`` 0) or is retried too.

    Batch counts every attempt against one budget: with ``retries`` 0 the job has the most
    attempts AWS allows (:data:`MAX_ATTEMPTS`), all for lost hosts; with ``retries`` N it
    has N + 1 attempts, for lost hosts and the program's failures alike.
    """
    if not isinstance(retries, int) or retries < 0:
        raise ValueError(f"--retries must be 0 or more, not {retries!r}")
    if retries >= MAX_ATTEMPTS:
        raise ValueError(f"--retries {retries} is more than AWS Batch allows: a job has at most "
                         f"{MAX_ATTEMPTS} attempts, so --retries {MAX_ATTEMPTS - 1} at most")
    if retries == 0:
        return {"attempts": MAX_ATTEMPTS, "evaluateOnExit": [HOST_LOST, {"onReason": "*", "action": "EXIT"}]}
    return {"attempts": retries + 1, "evaluateOnExit": [HOST_LOST, {"onReason": "*", "action": "RETRY"}]}


def exit_status(described: Mapping[str, Any]) -> int:
    """What ``fiber run`` exits with, from the ended job's ``DescribeJobs`` entry: its last
    attempt's exit status (``128 + N`` after signal ``N``), else 0 for a success, else 1."""
    code = final_code(described, None)
    return code if code >= 0 else 128 - code


def attempt_ended(attempt: Mapping[str, Any], number: int, attempts: int) -> str:
    """What ``fiber run`` says of attempt ``number`` (from 1) that ended while the job goes on."""
    container = attempt.get("container") or {}
    why = attempt.get("statusReason") or container.get("reason") or (
        f"exit status {container['exitCode']}" if container.get("exitCode") is not None else "no reason given")
    return f"attempt {number} of {attempts} ended ({why}); AWS Batch starts the program again"


def log_streams(described: Mapping[str, Any]) -> list[str]:
    """The log streams of the job's attempts, in order, each once (the running one last)."""
    names = [(a.get("container") or {}).get("logStreamName") for a in described.get("attempts") or []]
    names.append((described.get("container") or {}).get("logStreamName"))
    return list(dict.fromkeys(n for n in names if n))


def follow(batch: Any, logs: Any, log_group: str, job_id: str, out: TextIO | None = None,
           say: Callable[[str], None] = lambda m: print(f"fiber run: {m}", file=sys.stderr),
           poll: float = 1.0) -> int:
    """Copy the job's log (CloudWatch Logs) to ``out`` until the job ends; its exit status."""
    out = out or sys.stdout
    tokens: dict[str, str | None] = {}
    told = 0
    while True:
        described = call(batch, "describe_jobs", jobs=[job_id])["jobs"][0]
        for stream in log_streams(described):
            tokens[stream] = _copy_events(logs, log_group, stream, tokens.get(stream), out)
        attempts = described.get("attempts") or []
        attempts_allowed = (described.get("retryStrategy") or {}).get("attempts", 1)
        if described["status"] in FINAL:
            return exit_status(described)
        for number in range(told + 1, len(attempts) + 1):
            if attempts[number - 1].get("stoppedAt"):
                say(attempt_ended(attempts[number - 1], number, attempts_allowed))
                told = number
        time.sleep(poll)  # Batch has no watch: ask again


def _copy_events(logs: Any, group: str, stream: str, token: str | None, out: TextIO) -> str | None:
    """Write the stream's events after ``token``; the token to go on from."""
    while True:
        kwargs: dict[str, Any] = {"logGroupName": group, "logStreamName": stream, "startFromHead": True}
        if token:
            kwargs["nextToken"] = token
        try:
            resp = call(logs, "get_log_events", **kwargs)
        except AwsError:
            return token  # not there yet (Batch names a stream before its first line)
        for event in resp.get("events", []):
            out.write(event["message"].rstrip("\n") + "\n")
        out.flush()
        nxt = resp.get("nextForwardToken")
        if not resp.get("events") or not nxt or nxt == token:
            return nxt or token
        token = nxt
