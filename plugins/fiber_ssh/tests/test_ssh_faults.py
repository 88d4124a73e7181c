"""Network faults between the master and its workers on the SSH test hosts: partitions that
heal or do not, lost and duplicated packets.

Each fault is an ``iptables`` rule in a host's network namespace (and, for packets from
this process, in the root namespace), matched on this run's hub port only: the other runs
that share the test hosts (their parents have the same address) see nothing. ``tc netem``
would add delay and reordering, but the test machine's kernel has no ``netem`` (nor
``prio``): loss and duplication are iptables' ``statistic`` match and ``TEE`` target, delay
and reordering a netfilter queue (``test_ssh_delay.py``).
Faults start and end at points of the run's progress (results received), never after a
time; ``T`` bounds every wait.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fiber_core
import pytest
from test_ssh import fresh_runtime, hosts, ssh_env  # noqa: F401 (hosts: a fixture)

T = 60.0
REPO = Path(__file__).resolve().parents[3]
PARENT = "10.231.77.1"
"""The parent's address on the test bridge (hosts.env: FIBER_SSH_PARENT_ADDR)."""


def run_once(x: int, where: str) -> tuple[int, str]:
    """Record a run of ``x`` (a file per run, shared: the hosts are namespaces of this
    machine), do ~20 ms of work, return ``x`` and the host."""
    fd = os.open(os.path.join(where, f"{x}.{os.getpid()}.{time.monotonic_ns()}"),
                 os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    os.close(fd)
    time.sleep(0.02)  # the task's work
    return x, socket.gethostname()


def runs_per_item(where: Path) -> dict[int, int]:
    counts: dict[int, int] = {}
    for p in where.iterdir():
        x = int(p.name.split(".")[0])
        counts[x] = counts.get(x, 0) + 1
    return counts


def hub_port(rt: Any) -> int:
    """The TCP port this run's hub listens on for the SSH hosts' jobs."""
    addresses = rt.addresses_for(rt.get_backend(None))
    tcp = [a for a in addresses.split(",") if a.startswith("tcp:")][0]
    return int(tcp.rsplit(":", 1)[1])


class Rules:
    """iptables rules added for a test and removed at its end, whatever happens."""

    def __init__(self) -> None:
        self.added: list[list[str]] = []

    def add(self, netns: str | None, table: str, chain: str, *rule: str) -> None:
        cmd = (["ip", "netns", "exec", netns] if netns else []) + ["iptables", "-t", table]
        subprocess.run([*cmd, "-I", chain, *rule], check=True, timeout=T)
        self.added.append([*cmd, "-D", chain, *rule])

    def hits(self, netns: str | None, table: str) -> int:
        """Packets that the random rules of ``table`` in ``netns`` matched so far."""
        cmd = (["ip", "netns", "exec", netns] if netns else []) + ["iptables", "-t", table, "-v", "-S"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=T).stdout
        return sum(int(line.split(" -c ")[1].split()[0]) for line in out.splitlines()
                   if "statistic" in line and " -c " in line)

    def clear(self) -> None:
        while self.added:
            subprocess.run(self.added.pop(), timeout=T)

    def partition(self, host: str, port: int) -> None:
        """Drop every packet between ``host`` and this run's hub, both ways."""
        self.add(host, "filter", "OUTPUT", "-p", "tcp", "-d", PARENT, "--dport", str(port), "-j", "DROP")
        self.add(host, "filter", "INPUT", "-p", "tcp", "-s", PARENT, "--sport", str(port), "-j", "DROP")

    def lossy(self, host: str, address: str, port: int, probability: float) -> None:
        """Drop and duplicate ``probability`` of the packets between ``host`` and the hub."""
        p = str(probability)
        stat = ["-m", "statistic", "--mode", "random", "--probability", p]
        self.add(host, "filter", "OUTPUT", "-p", "tcp", "-d", PARENT, "--dport", str(port), *stat, "-j", "DROP")
        self.add(host, "filter", "INPUT", "-p", "tcp", "-s", PARENT, "--sport", str(port), *stat, "-j", "DROP")
        self.add(host, "mangle", "OUTPUT", "-p", "tcp", "-d", PARENT, "--dport", str(port), *stat,
                 "-j", "TEE", "--gateway", PARENT)
        self.add(None, "mangle", "OUTPUT", "-p", "tcp", "-s", PARENT, "--sport", str(port), "-d", address,
                 *stat, "-j", "TEE", "--gateway", address)


@pytest.fixture
def rules(hosts: dict[str, str]) -> Iterator[Rules]:  # noqa: F811
    r = Rules()
    try:
        yield r
    finally:
        r.clear()


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory the hosts see too (each host has a /tmp of its own; the repository is shared)."""
    base = REPO / "test-artifacts"
    base.mkdir(exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="ssh-faults-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def pool_on_the_hosts(hosts: dict[str, str], **settings: str) -> Iterator[tuple[Any, Any]]:  # noqa: F811
    env = ssh_env(hosts, orphan_timeout="5")
    env.update({f"FIBER_{k.upper()}": v for k, v in settings.items()})
    with fresh_runtime(env) as rt:
        pool = fiber_core.Pool(6)
        try:
            yield rt, pool
        finally:
            pool.terminate()


def _partitioned(hosts: dict[str, str], rules: Rules, where: Path, heals: bool,  # noqa: F811
                 **settings: str) -> tuple[list[tuple[int, str]], dict[str, Any], dict[int, int]]:
    n = 400
    with pool_on_the_hosts(hosts, **settings) as (rt, pool):
        port = hub_port(rt)
        it = pool.imap_unordered(_task(where), range(n), chunksize=1)
        got = [it.next(T) for _ in range(60)]
        assert "fiber-h2" in {h for _, h in got}, "fiber-h2 runs tasks before the cut"
        rules.partition("fiber-h2", port)
        # The others go on; the partition lasts while they deliver 100 results, then heals
        # (or not). The order of results is the run's own clock.
        for _ in range(100):
            got.append(it.next(T))
        if heals:
            rules.clear()
        got += [it.next(4 * T) for _ in range(n - len(got))]
        if not heals:  # the workers cut off are lost once their jobs' ends are known
            wait_until(lambda: pool.status_snapshot()["losses"], "the lost workers are counted")
        snap = pool.status_snapshot()
    return got, snap, runs_per_item(where)


def wait_until(predicate: Any, what: str) -> None:
    """Poll state that has no event to wait on; fail after ``T``."""
    deadline = time.monotonic() + T
    pause = threading.Event()
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        pause.wait(0.05)


def others_only(losses: dict[str, int]) -> bool:
    """Whether the losses are none, or only hosts lost to what other runs do to the shared test
    hosts (they cut links and stop sshd): this test's rules touch its hub port only, so they
    can make a worker unresponsive, never lose a host."""
    return set(losses) <= {"host-lost"}


def _task(where: Path) -> Any:
    return functools.partial(run_once, where=str(where))


@pytest.mark.timeout(600)
def test_a_partition_that_heals_within_the_bound_loses_nothing_and_runs_nothing_twice(
        hosts: dict[str, str], rules: Rules, shared_dir: Path) -> None:  # noqa: F811
    got, snap, runs = _partitioned(hosts, rules, shared_dir, heals=True, heartbeat_timeout="120")
    assert sorted(x for x, _ in got) == list(range(400))
    assert others_only(snap["losses"]), snap["last_loss"]  # the workers of fiber-h2 came back
    if not snap["losses"]:
        assert set(runs.values()) == {1}  # not even a task the program cannot see ran twice
    hosts_during = [h for _, h in got[60:160]]
    hosts_after = [h for _, h in got[160:]]
    assert hosts_during.count("fiber-h2") <= 4  # (sent before the cut) the partition held
    assert "fiber-h2" in hosts_after  # its workers came back


@pytest.mark.timeout(600)
def test_a_partition_that_does_not_heal_loses_the_hosts_workers_and_no_result(
        hosts: dict[str, str], rules: Rules, shared_dir: Path) -> None:  # noqa: F811
    got, snap, runs = _partitioned(hosts, rules, shared_dir, heals=False, heartbeat_timeout="3")
    assert sorted(x for x, _ in got) == list(range(400))  # each once, though some ran twice
    assert snap["losses"].get("unresponsive", 0) >= 1, snap  # found by their missing heartbeats
    assert set(runs) == set(range(400))


@pytest.mark.timeout(600)
def test_lost_and_duplicated_packets_lose_no_result(hosts: dict[str, str], rules: Rules,  # noqa: F811
                                                    shared_dir: Path) -> None:
    addresses = dict(zip(hosts["FIBER_SSH_HOSTNAMES"].split(), hosts["FIBER_SSH_HOSTS"].split()))
    n = 1000
    with pool_on_the_hosts(hosts) as (rt, pool):
        port = hub_port(rt)
        for host, address in addresses.items():
            rules.lossy(host, address, port, 0.01)
        got = list(pool.imap_unordered(_task(shared_dir), range(n), chunksize=1))
        snap = pool.status_snapshot()
        dropped = sum(rules.hits(host, "filter") for host in addresses)
        copied = sum(rules.hits(host, "mangle") for host in addresses) + rules.hits(None, "mangle")
    assert dropped and copied, (dropped, copied)  # the faults happened
    assert sorted(x for x, _ in got) == list(range(n))
    assert others_only(snap["losses"]), snap["last_loss"]  # TCP hides them: no worker is lost
    if not snap["losses"]:
        assert set(runs_per_item(shared_dir).values()) == {1}
