"""Delayed and reordered packets between the master and its workers on the SSH test hosts.

The kernel of the test machine has no ``tc netem``: each host's network namespace gets a
netfilter queue for this run's hub port instead, served by ``fiber_core.testing.netdelay``,
which holds every packet of the hub's connections for a seeded, drawn delay and lets a drawn
fraction go after later ones. The rules match this run's hub port only (the other runs that
share the hosts see nothing) and go when the test ends, whatever happens. The seed is printed
(``FIBER_CHAOS_SEED=...``); the same seed gives the n-th packet of each host the same delay.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from fiber_core.testing.faults import chaos_seed
from fiber_core.testing.netdelay import Counters, PacketDelay, Shape
from test_ssh import hosts  # noqa: F401 (a fixture)
from test_ssh_faults import (
    PARENT,
    T,
    _task,
    hub_port,
    others_only,
    pool_on_the_hosts,
    runs_per_item,
    shared_dir,  # noqa: F401 (a fixture)
)


def _map_through(hosts: dict[str, str], where: Path, shape: Shape,  # noqa: F811
                 n: int) -> tuple[list[tuple[int, str]], dict, list[Counters]]:
    seed = chaos_seed()
    names = hosts["FIBER_SSH_HOSTNAMES"].split()
    with pool_on_the_hosts(hosts) as (rt, pool):
        port = hub_port(rt)
        with contextlib.ExitStack() as stack:  # every host's rules go, whatever happens
            delays = [stack.enter_context(PacketDelay(port, PARENT, netns=name, shape=shape,
                                                      seed=seed + k, timeout=T))
                      for k, name in enumerate(names)]
            it = pool.imap_unordered(_task(where), range(n), chunksize=1)
            got = [it.next(T) for _ in range(n)]
            snap = pool.status_snapshot()
    return got, snap, [d.final or Counters() for d in delays]


@pytest.mark.timeout(600)
def test_a_map_with_every_hub_packet_delayed_50_to_200_ms_gives_every_result_once(
        hosts: dict[str, str], shared_dir: Path) -> None:  # noqa: F811
    n = 300
    got, snap, counters = _map_through(hosts, shared_dir, Shape(delay=(0.05, 0.2)), n)
    assert sorted(x for x, _ in got) == list(range(n))
    assert others_only(snap["losses"]), snap["last_loss"]  # a delay is not a loss
    if not snap["losses"]:
        assert set(runs_per_item(shared_dir).values()) == {1}
    hosts_used = {h for _, h in got}
    for name, c in zip(hosts["FIBER_SSH_HOSTNAMES"].split(), counters):
        if name in hosts_used:  # the tool held every packet of the host's hub connections
            assert c.released == c.queued > 0, (name, c)
            assert c.delayed + c.early >= c.released, (name, c)  # the end may cut a hold short
            assert c.delay_mean >= 0.05, (name, c)


@pytest.mark.timeout(600)
def test_a_map_with_hub_packets_reordered_gives_every_result_once(
        hosts: dict[str, str], shared_dir: Path) -> None:  # noqa: F811
    n = 600
    shape = Shape(delay=(0.0, 0.005), reorder=0.2, hold=(0.02, 0.08))
    got, snap, counters = _map_through(hosts, shared_dir, shape, n)
    assert sorted(x for x, _ in got) == list(range(n))
    assert others_only(snap["losses"]), snap["last_loss"]
    if not snap["losses"]:
        assert set(runs_per_item(shared_dir).values()) == {1}
    assert sum(c.reordered for c in counters) > 0, counters  # packets really passed later ones
    assert all(c.released == c.queued for c in counters), counters
