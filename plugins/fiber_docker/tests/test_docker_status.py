"""What the daemon says of a container, as fiber_docker.status reads it: pure, no daemon."""

from __future__ import annotations

import sys

import pytest
from fiber_core.contract import EndReason

from fiber_docker.status import check_verdict, container_end, exitcode, thaw_to_signal


def test_a_shell_style_status_is_multiprocessings_exit_code() -> None:
    assert (exitcode(0), exitcode(3), exitcode(137), exitcode("143")) == (0, 3, -9, -15)


@pytest.mark.parametrize("code, oom, outside, stop_requested, reason", [
    (-9, True, None, False, EndReason.OOM),
    (1, True, None, False, None),  # the flag says the exit was the OOM kill only with SIGKILL's code
    (-15, False, "SIGTERM", False, EndReason.PREEMPTED),  # someone's docker stop
    (-15, False, "SIGTERM", True, None),  # Fiber asked for it: STOPPED, from the state
    (0, False, None, False, None),
    (-9, False, None, False, EndReason.KILLED),  # kill -9 inside: OOMKilled false, no kill event
    (-9, None, None, False, None),  # removed before it was inspected: it may have been the OOM kill
    (-9, False, "SIGKILL", False, EndReason.PREEMPTED),  # someone's docker kill
    (-9, False, None, True, None),  # Fiber's kill: STOPPED, from the state
])
def test_why_a_container_ended(code: int, oom: bool | None, outside: str | None, stop_requested: bool,
                               reason: EndReason | None) -> None:
    got, detail = container_end(code, oom=oom, outside_signal=outside, stop_requested=stop_requested, memory=64)
    assert got is reason
    assert ("64 MiB" in detail) == (reason is EndReason.OOM)


def test_the_image_check_says_what_is_missing() -> None:
    here = f"{sys.version_info[0]} {sys.version_info[1]}"
    assert check_verdict(0, f"fiber-check {here} 1.0\n", "python3", "img", 120, "1.0").ok
    assert check_verdict(0, f"fiber-check {here} 0.9\n", "python3", "img", 120, "1.0").warnings
    assert check_verdict(None, "", "python3", "img", 120, None).transient
    assert "has no 'python3'" in check_verdict(127, "exec failed", "python3", "img", 120, None).message
    assert "not fiber-core" in check_verdict(1, "No module named 'fiber_core'", "python3", "img", 120, None).message


def test_a_paused_container_is_thawed_for_every_signal_but_sigkill_which_the_daemon_thaws_for() -> None:
    assert thaw_to_signal("SIGTERM", paused=True)
    assert not thaw_to_signal("SIGKILL", paused=True)
    assert not thaw_to_signal("SIGTERM", paused=False)
