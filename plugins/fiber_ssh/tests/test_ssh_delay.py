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
from typing import Any

import fiber_core
import pytest
from fiber_core.testing.faults import chaos_seed
from fiber_core.testing.netdelay import Counters, PacketDelay, Shape
from test_ssh import fresh_runtime, hosts, ssh_env  # noqa: F401 (hosts: a fixture)
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


def _delayed(stack: contextlib.ExitStack, hosts: dict[str, str], port: int,  # noqa: F811
             shape: Shape) -> list[PacketDelay]:
    """The tool on every host, for this run's hub port, seeded from the chaos seed (printed)."""
    seed = chaos_seed()
    return [stack.enter_context(PacketDelay(port, PARENT, netns=name, shape=shape, seed=seed + k, timeout=T))
            for k, name in enumerate(hosts["FIBER_SSH_HOSTNAMES"].split())]


def _map_through(hosts: dict[str, str], where: Path, shape: Shape,  # noqa: F811
                 n: int) -> tuple[list[tuple[int, str]], dict, list[Counters]]:
    with pool_on_the_hosts(hosts) as (rt, pool):
        with contextlib.ExitStack() as stack:  # every host's rules go, whatever happens
            delays = _delayed(stack, hosts, hub_port(rt), shape)
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


def echo_in_order(inbox: Any, outbox: Any, conn: Any, n: int) -> None:
    """Pass each of ``n`` items from ``inbox`` to both ``outbox`` and ``conn``, in order."""
    for _ in range(n):
        x = inbox.get(timeout=T)
        outbox.put(x)
        conn.send(x)
    conn.close()


@pytest.mark.timeout(600)
def test_queues_and_a_pipe_to_a_host_deliver_every_message_once_in_order_through_reordered_packets(
        hosts: dict[str, str]) -> None:  # noqa: F811
    n = 400
    shape = Shape(delay=(0.0, 0.05), reorder=0.2, hold=(0.02, 0.08))
    with fresh_runtime(ssh_env(hosts)) as rt, contextlib.ExitStack() as stack:
        delays = _delayed(stack, hosts, hub_port(rt), shape)
        inbox, outbox = fiber_core.Queue(), fiber_core.Queue()
        here, there = fiber_core.Pipe()
        p = fiber_core.Process(target=echo_in_order, args=(inbox, outbox, there, n))
        p.start()
        for x in range(n):
            inbox.put(x)
        via_queue = [outbox.get(timeout=T) for _ in range(n)]
        via_pipe = []
        for _ in range(n):
            assert here.poll(T), f"the pipe went quiet after {len(via_pipe)} messages"
            via_pipe.append(here.recv())
        p.join(T)
        stack.close()  # the rules go; the final counters
        counters = [d.final or Counters() for d in delays]
    assert p.exitcode == 0
    assert via_queue == via_pipe == list(range(n))
    assert sum(c.reordered for c in counters) > 0, counters
