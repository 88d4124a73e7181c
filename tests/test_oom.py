"""Telling an out-of-memory kill from another SIGKILL: the cgroup's count, and the local backend's end reason."""

from __future__ import annotations

import os
import signal
import time

import pytest

import fiber_core
from fiber_core.base.oom import counter_files, oom_kills, parse_count
from fiber_core.contract.jobs import EndReason


def test_the_counter_files_follow_the_cgroup_of_each_version() -> None:
    v1 = "4:memory:/run/abc\n3:cpu:/run/abc\n"
    assert counter_files(v1, "/cg")[0] == "/cg/memory/run/abc/memory.oom_control"
    v2 = "0::/user.slice/x.scope\n"
    assert counter_files(v2, "/cg")[:2] == ["/cg/user.slice/x.scope/memory.events",
                                            "/cg/unified/user.slice/x.scope/memory.events"]
    assert counter_files("", "/cg") == ["/cg/memory.events"]  # a container's own root
    assert counter_files("garbage\n1:cpu:/\n", "/cg") == ["/cg/memory.events"]


def test_the_count_is_read_from_either_file_and_garbage_is_unknown() -> None:
    assert parse_count("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\n") == 2
    assert parse_count("oom_kill_disable 0\nunder_oom 0\noom_kill 7\n") == 7
    assert parse_count("oom_kill x\n") is None
    assert parse_count("") is None


def _sleep() -> None:
    time.sleep(60)  # killed by the test long before


@pytest.mark.skipif(oom_kills() is None, reason="no memory cgroup count to read here")
def test_a_local_job_killed_from_outside_ended_killed_not_oom() -> None:
    p = fiber_core.Process(target=_sleep)
    p.start()
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    assert p.job is not None and p.job.state.reason is EndReason.KILLED
    assert not EndReason.KILLED.infrastructure  # the program may have sent it itself
