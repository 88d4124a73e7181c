"""Why a job on an SSH host ended, as fiber_ssh.status reads it: pure, no host."""

from __future__ import annotations

import pytest
from fiber_core.contract import HOST_LOST_EXITCODE, EndReason

from fiber_ssh.status import Seen, job_end


@pytest.mark.parametrize("seen, code, reason, says", [
    (Seen("h1", reported=0, started=True), 0, None, ""),
    (Seen("h1", reported=-15, started=True, stop_requested=True), -15, None, ""),  # STOPPED, by the state
    (Seen("h1", reported=127, error="no such file"), 127, EndReason.NEVER_STARTED, "h1: no such file"),
    (Seen("h1", reported=-9, oom=True, started=True), -9, EndReason.OOM, "out-of-memory killer"),
    (Seen("h1", reported=-9, oom=True, started=True, stop_requested=True), -9, None, ""),  # Fiber's kill
    (Seen("h1", reported=-9, killed=True, started=True), -9, EndReason.KILLED, "not by the out-of-memory"),
    (Seen("h1", reported=-9, killed=True, started=True, stop_requested=True), -9, None, ""),  # Fiber's kill
    (Seen("h1", reported=-9, started=True), -9, None, ""),  # no cgroup count: it may have been the OOM kill
    (Seen("h1", closing=True, connected=False), HOST_LOST_EXITCODE, EndReason.STOPPED, "closed by cleanup()"),
    (Seen("h1", connected=False, broke="reset"), HOST_LOST_EXITCODE, EndReason.HOST_LOST, "broke (reset)"),
    (Seen("h1", exit_status=137, started=True), -9, None, "exited with status -9"),
    (Seen("h1", exit_status=1), 1, EndReason.NEVER_STARTED, "exited with status 1"),  # it never ran the job
    (Seen("h1"), HOST_LOST_EXITCODE, EndReason.HOST_LOST, "without an exit status"),
])
def test_why_a_job_ended(seen: Seen, code: int, reason: EndReason | None, says: str) -> None:
    got = job_end(seen)
    assert got[:2] == (code, reason) and says in got[2]
