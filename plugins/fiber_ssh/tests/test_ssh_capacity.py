"""Capacity kinds on SSH hosts: the ``capacity=spot|on-demand`` label of the hosts file, placement
by kind, the loss of a spot host as a preemption, and Flyte's rule on top of it.

The pure parts (the label, placement, why a job ended) need no host; the rest runs on the SSH
test hosts. A host is lost to this test alone: its SSH connection (this process's port) is cut
by an iptables rule in the host's namespace, so the other runs that share the hosts see nothing.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import fiber_core
import pytest
from fiber_core.base.errors import BackendError, ConfigError
from fiber_core.contract import HOST_LOST_EXITCODE, Alternative, EndReason, GpuChoice
from test_ssh import GOT, T, _record, fresh_runtime, hosts, make_backend, py, ssh_env  # noqa: F401 (fixtures)
from test_ssh_faults import PARENT, Rules, rules  # noqa: F401 (a fixture)

from fiber_ssh.hosts import Slots, parse_host, place, place_alternative
from fiber_ssh.status import Seen, job_end

SPOT, ON_DEMAND = Alternative(capacity="spot"), Alternative(capacity="on-demand")


# -- the label, placement and why a job ended: pure ------------------------------------------------


def test_a_host_is_on_demand_unless_labelled_spot() -> None:
    assert parse_host("h1*8").capacity == "on-demand"
    assert parse_host("h1*8[capacity=spot,cost=0.4]").capacity == "spot"
    assert parse_host("h1[capacity=On-Demand]").capacity == "on-demand"
    with pytest.raises(ConfigError, match=r"capacity is the kind of machine, spot or on-demand \(capacity=spot\)"):
        parse_host("h1[capacity=preemptible]")


def test_a_job_of_one_kind_goes_to_a_host_of_that_kind_only() -> None:
    slots = [Slots("od", 8), Slots("spot", 1, capacity="spot")]
    assert place_alternative(slots, None, [SPOT])[0].index == 1
    assert place_alternative(slots, None, [SPOT])[0].index == 1  # full: over its slots, still spot
    assert place_alternative(slots, None, [ON_DEMAND])[0].index == 0
    with pytest.raises(BackendError, match=r"no SSH host is labelled capacity=spot \(hosts: od \(on-demand\)\); "
                                           r"label the spot hosts in \[ssh\] hosts, e.g. 'spot1\*8\[capacity=spot\]'"):
        place([Slots("od", 8)], capacity="spot")


def test_spot_then_on_demand_prefers_a_spot_host_with_room_then_an_on_demand_one() -> None:
    slots = [Slots("od", 2), Slots("spot", 1, capacity="spot")]
    both = [SPOT, ON_DEMAND]
    got = [place_alternative(slots, None, both) for _ in range(4)]
    assert [(p.index, alt.capacity) for p, alt in got] == [(1, "spot"), (0, "on-demand"), (0, "on-demand"),
                                                           (1, "spot")]  # none free: the first, over its slots
    slots[1].alive = False  # the spot host is lost: on-demand only
    assert place_alternative(slots, None, both)[1] == ON_DEMAND


def test_gpu_alternatives_within_capacity_kinds_go_in_order() -> None:
    slots = [Slots("l4-od", 4, 1, "l4"), Slots("a100-spot", 4, 1, "a100", capacity="spot")]
    places = [Alternative(GpuChoice("a100"), "spot"), Alternative(GpuChoice("l4"), "spot"),
              Alternative(GpuChoice("a100"), "on-demand"), Alternative(GpuChoice("l4"), "on-demand")]
    assert [str(place_alternative(slots, None, places)[1]) for _ in range(2)] == ["a100:1 spot", "l4:1 on-demand"]
    with pytest.raises(BackendError, match=r"any of the alternatives h100:1 spot, h100:1 on-demand"):
        place_alternative(slots, None, [Alternative(GpuChoice("h100"), "spot"), Alternative(GpuChoice("h100"), "on-demand")])


def test_a_lost_spot_host_preempts_its_jobs_a_lost_on_demand_host_loses_them() -> None:
    assert job_end(Seen("h1", connected=False, broke="reset", spot=True)) == (
        HOST_LOST_EXITCODE, EndReason.PREEMPTED, "lost spot host h1: the connection broke (reset)")
    assert job_end(Seen("h1", spot=True))[1] is EndReason.PREEMPTED  # the channel closed, no exit status
    assert job_end(Seen("h1", connected=False, broke="reset"))[1] is EndReason.HOST_LOST
    assert job_end(Seen("h1", closing=True, connected=False, spot=True))[1] is EndReason.STOPPED  # cleanup's
    assert job_end(Seen("h1", reported=0, started=True, spot=True))[1] is None  # its own exit


# -- on the test hosts ------------------------------------------------------------------------------


def cut_connection(into: Rules, netns: str, transport: Any) -> None:
    """Drop every packet of one SSH connection of this process to ``netns``'s host, both ways:
    that host is lost to this backend only (its keepalives go unanswered)."""
    port = str(transport.sock.getsockname()[1])
    into.add(netns, "filter", "OUTPUT", "-p", "tcp", "--sport", "22", "-d", PARENT, "--dport", port, "-j", "DROP")
    into.add(netns, "filter", "INPUT", "-p", "tcp", "-s", PARENT, "--sport", port, "--dport", "22", "-j", "DROP")


def test_jobs_go_to_hosts_of_the_kind_they_ask_for_and_know_it(make_backend: Any, hosts: dict[str, str]) -> None:  # noqa: F811
    h1, h2, h3 = hosts["FIBER_SSH_HOSTS"].split()
    b = make_backend(hosts=f"{h1}*1[capacity=spot,cost=0.3], {h2}*1[capacity=on-demand], {h3}*1")
    spot = b.start_job(py(GOT, capacity="spot"))
    fallback = [b.start_job(py(GOT, capacity="spot-then-on-demand")) for _ in range(2)]
    on_demand = b.start_job(py(GOT, capacity="on-demand"))
    got = [(j.host, _record(b, j)["capacity"]) for j in [spot, *fallback, on_demand]]
    assert got[0] == ("fiber-h1", "spot") and _record(b, spot)["cost_per_hour"] == 0.3
    # The spot host is full: spot-then-on-demand takes the on-demand hosts with room, then on-demand
    # shares one (h3 has no label: on-demand).
    assert sorted(got[1:3]) == [("fiber-h2", "on-demand"), ("fiber-h3", "on-demand")]
    assert got[3][1] == "on-demand" and got[3][0] in ("fiber-h2", "fiber-h3")
    for job in [spot, *fallback, on_demand]:
        b.stop_job(job, force=True)


def test_a_job_on_a_spot_host_that_is_lost_ends_preempted(make_backend: Any, hosts: dict[str, str],  # noqa: F811
                                                          rules: Rules) -> None:  # noqa: F811
    h1, h2, _ = hosts["FIBER_SSH_HOSTS"].split()
    b = make_backend(hosts=f"{h1}*2[capacity=spot], {h2}*2", orphan_timeout=5.0, retry_lost=1.0)
    on_spot = b.start_job(py(GOT, capacity="spot"))
    on_demand = b.start_job(py(GOT, capacity="on-demand"))
    assert _record(b, on_spot)["capacity"] == "spot" and on_spot.host == "fiber-h1"
    _record(b, on_demand)
    cut_connection(rules, "fiber-h1", on_spot.handle.transport)
    assert b.wait_for_job(on_spot, T) == HOST_LOST_EXITCODE
    assert b.end_reason(on_spot) is EndReason.PREEMPTED
    assert on_spot.state.detail.startswith("lost spot host ")
    assert b.poll_job(on_demand) is None  # the other host's job runs on
    b.stop_job(on_demand, force=True)


def runs_where_on_demand(x: int) -> tuple[int, str, str | None]:
    """``x``, the worker and the capacity it ran on, once on on-demand capacity; on spot it waits
    to be preempted."""
    got = fiber_core.current_process().resources
    if got["capacity"] != "on-demand":
        time.sleep(600)
    return x, fiber_core.current_process().name, got["capacity"]


@pytest.mark.parametrize("role", [None, "learner"])
def test_a_task_on_a_lost_spot_host_runs_its_next_attempt_on_an_on_demand_worker(hosts: dict[str, str],  # noqa: F811
                                                                                 rules: Rules,  # noqa: F811
                                                                                 role: str | None) -> None:
    h1, h2, _ = hosts["FIBER_SSH_HOSTS"].split()
    env = {**ssh_env(hosts), "FIBER_SSH_HOSTS": f"{h1}*1[capacity=spot], {h2}*2", "FIBER_SPARE_JOBS": "0",
           "FIBER_SSH_ORPHAN_TIMEOUT": "5", "FIBER_SSH_RETRY_LOST": "1"}
    spot = {"capacity": "spot-then-on-demand", "on_demand_after": 1}
    # Without a role, the pool's own workers are on spot; with one, the role's (the others anywhere).
    keywords: dict[str, Any] = spot if role is None else {"roles": {role: {"processes": 1, **spot}}}
    with fresh_runtime(env), fiber_core.Pool(1, **keywords) as pool:
        result = pool.apply_async(runs_where_on_demand, (7,), role=role)
        on_spot = pool if role is None else pool._roles[role]
        deadline = time.monotonic() + T
        while True:  # polled: the pool's table has no event to wait on
            with on_spot._lock:
                busy = [w for w in on_spot._workers.values() if w.pending and w.ready and w.process.job is not None]
            if busy:
                break
            assert time.monotonic() < deadline, "no worker ran the task"
            threading.Event().wait(0.05)
        job = busy[0].process.job
        assert job.host == "fiber-h1"
        cut_connection(rules, "fiber-h1", job.handle.transport)
        name = "PoolWorker-on-demand-1" if role is None else f"PoolWorker-{role}-on-demand-1"
        assert result.get(2 * T) == (7, name, "on-demand")
        assert job.state.reason is EndReason.PREEMPTED
