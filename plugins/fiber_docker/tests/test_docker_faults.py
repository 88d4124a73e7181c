"""Gray failures of Docker workers: a paused container, and a container cut off from the master.

A paused container (``docker pause``: the cgroup freezer) is alive, its sockets open, silent:
only the pool's heartbeats can tell. A partition is two ``iptables`` rules in this machine's
namespace (the containers run with host networking, so there is no bridge to disconnect):
one drops what the container's cgroup sends to this run's hub port (``-m cgroup --path``),
the other what the hub sends to that container's connections (their local ports, read from
the kernel's socket table). Both are scoped to one container and this run's hub port, and
removed in a ``finally``: nothing else on the machine sees them.

Each fault strikes at a point of the run's progress a seed draws (``FIBER_CHAOS_SEED``
replays it), on a worker the seed picks, and heals (or not) a hundred results later: the
run's own clock, never a time. ``WAIT`` bounds every wait.

A signal sent in the first moments of a container would be lost (before ``docker-init``
has blocked the signals it forwards, the kernel drops them): the backend waits for the init
to run the job's command first, and a test stops containers as soon as they run.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import docker
import docker_tasks
import fiber_core
import pytest
from docker_service import IMAGE
from fiber_core.contract import EndReason, Job, JobSpec
from fiber_core.runtime.config import config, create_backend
from fiber_core.runtime.run import runtime
from fiber_core.testing.faults import FaultSchedule, chaos_seed

from fiber_docker.backend import DockerBackend

WAIT = 120.0  # bound of every wait: reaching it is a failure, never a measure of speed
N = 300  # items of each map, ~20 ms each
WORKERS = 3
CUT_AFTER = (40, 120)  # the results between which the fault strikes (the seed draws where)
HEALED_AFTER = 100  # results the other workers deliver before a fault that heals is undone


# -- pure: where a container's traffic is -----------------------------------------------------


def cgroup2_path(proc_cgroup: str) -> str:
    """A process's cgroup v2 path (the ``0::`` line of ``/proc/PID/cgroup``): what
    ``iptables -m cgroup --path`` matches, relative to the cgroup2 root."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise LookupError("no cgroup v2 line (0::) in /proc/PID/cgroup: the kernel mounts no cgroup2 hierarchy")


def local_ports(proc_net_tcp: str, inodes: set[int], remote_port: int) -> set[int]:
    """The local ports of the sockets among ``inodes`` connected to ``remote_port``, from the
    text of ``/proc/net/tcp`` (addresses in hex, the inode in the tenth column)."""
    ports = set()
    for line in proc_net_tcp.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or int(fields[9]) not in inodes:
            continue
        if int(fields[2].rsplit(":", 1)[1], 16) == remote_port:
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


TCP_TABLE = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:9C41 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1001 1 0
   1: 0100007F:D431 0100007F:9C41 01 00000000:00000000 00:00000000 00000000     0        0 2002 1 0
   2: 0100007F:D432 0100007F:9C41 01 00000000:00000000 00:00000000 00000000     0        0 3003 1 0
   3: 0100007F:D433 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 4004 1 0
"""


def test_the_local_ports_are_those_of_the_containers_sockets_to_the_hub_only() -> None:
    assert local_ports(TCP_TABLE, {2002, 4004}, 0x9C41) == {0xD431}  # 4004 goes elsewhere, 3003 is not its
    assert local_ports(TCP_TABLE, {1001}, 0x9C41) == set()  # the listener has no peer


def test_the_cgroup_path_is_the_v2_line_and_its_absence_is_named() -> None:
    text = "4:memory:/fiber-test/abc\n0::/fiber-test/abc\n"
    assert cgroup2_path(text) == "/fiber-test/abc"
    with pytest.raises(LookupError, match="no cgroup v2"):
        cgroup2_path("4:memory:/fiber-test/abc\n")


# -- I/O: the faults ---------------------------------------------------------------------------


class Partition:
    """Cuts one container off this run's hub, both ways, until :meth:`heal` (``iptables`` in
    this machine's namespace, where the containers' host networking puts their sockets)."""

    def __init__(self, api: docker.APIClient, container: str, hub_port: int) -> None:
        self.api, self.container, self.port = api, container, hub_port
        self.rules: list[list[str]] = []
        self.dropped = 0  # packets the rules dropped, counted when they are removed

    def cut(self) -> None:
        pid = self.api.inspect_container(self.container)["State"]["Pid"]
        path = cgroup2_path(Path(f"/proc/{pid}/cgroup").read_text())
        # What the container sends to the hub, its new connections' SYNs included:
        self._add("-p", "tcp", "-d", "127.0.0.1", "--dport", str(self.port),
                  "-m", "cgroup", "--path", path, "-j", "DROP")
        # What the hub sends to the container: on loopback the cgroup of the receiving
        # socket is not known in INPUT, so the rule names the container's connections.
        for port in sorted(self._connections(pid)):
            self._add("-p", "tcp", "-s", "127.0.0.1", "--sport", str(self.port),
                      "-d", "127.0.0.1", "--dport", str(port), "-j", "DROP")

    def _connections(self, pid: int) -> set[int]:
        """Local ports of the connections that the container's processes hold to the hub."""
        titles, rows = (lambda top: (top["Titles"], top["Processes"]))(self.api.top(self.container))
        inodes = set()
        for row in rows:
            proc = Path(f"/proc/{row[titles.index('PID')]}/fd")
            with contextlib.suppress(OSError):  # a process that ended meanwhile
                for fd in proc.iterdir():
                    with contextlib.suppress(OSError):
                        target = os.readlink(fd)
                        if target.startswith("socket:["):
                            inodes.add(int(target[8:-1]))
        return local_ports(Path(f"/proc/{pid}/net/tcp").read_text(), inodes, self.port)

    def _add(self, *rule: str) -> None:
        subprocess.run(["iptables", "-I", "OUTPUT", *rule], check=True, timeout=WAIT)
        self.rules.append(list(rule))

    def _count(self) -> int:
        """Packets the rules in place dropped so far (``iptables -S`` writes a rule as it was
        added, with its counters in ``-c PACKETS BYTES``)."""
        out = subprocess.run(["iptables", "-v", "-S", "OUTPUT"], capture_output=True, text=True,
                             check=True, timeout=WAIT).stdout
        return sum(int(line.split(" -c ")[1].split()[0]) for line in out.splitlines()
                   if " -c " in line and "-j DROP" in line
                   and (f"--sport {self.port} " in line or f"--dport {self.port} " in line))

    def heal(self) -> None:
        if self.rules:
            with contextlib.suppress(subprocess.SubprocessError, IndexError, ValueError):
                self.dropped += self._count()
        while self.rules:
            subprocess.run(["iptables", "-D", "OUTPUT", *self.rules.pop()], timeout=WAIT)


@pytest.fixture
def task_log() -> Iterator[Path]:
    """A directory the containers see too (the working directory is mounted at its own path)."""
    base = Path.cwd() / "test-artifacts"
    base.mkdir(exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="docker-faults-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def runs_per_item(where: Path) -> dict[int, int]:
    counts: dict[int, int] = {}
    for p in where.iterdir():
        x = int(p.name.split(".")[0])
        counts[x] = counts.get(x, 0) + 1
    return counts


@contextlib.contextmanager
def configured(**settings: float) -> Iterator[None]:
    """``fiber_core.init(**settings)`` for the block, then the environment's configuration again."""
    fiber_core.init(**settings)
    try:
        yield
    finally:
        config.reset()


def serving_containers(pool: fiber_core.Pool) -> list[tuple[str, str]]:
    """(worker name, container id) of a pool's connected workers not lost, by worker number."""
    with pool._lock:
        return [(w.process.name, w.process.job.id) for _, w in sorted(pool._workers.items())
                if not w.lost and w.conn is not None and w.process.job is not None]


def wait_until(predicate: Callable[[], Any], what: str) -> None:
    """Poll state that has no event to wait on; fail after ``WAIT``."""
    deadline = time.monotonic() + WAIT
    pause = threading.Event()
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        pause.wait(0.05)


def gone(api: docker.APIClient, container: str) -> bool:
    return not api.containers(all=True, filters={"id": container})


Fault = Callable[[str], Callable[[], None]]
"""Strikes a container (by id); returns what heals it."""


class Outcome(NamedTuple):
    got: list[tuple[int, str]]  # (item, worker name) in the order the results came
    struck_at: int  # results before the fault
    healed_at: int  # results before it healed (or would have)
    snap: dict[str, Any]  # the pool's live view at the end
    worker: str  # the struck worker's name
    container: str  # its container
    runs: dict[int, int]  # runs per item, from the task log


def _faulted_map(api: docker.APIClient, where: Path, strike: Fault, heals: bool) -> Outcome:
    """A map of ``N`` logged tasks on ``WORKERS`` containers; at a seeded point, ``strike``
    one of them (a seeded pick); heal it ``HEALED_AFTER`` results later, or never."""
    schedule = FaultSchedule.spread(chaos_seed(), results=N, count=1, kinds=("fault",),
                                    first=CUT_AFTER[0], last=CUT_AFTER[1])
    fault = schedule.faults[0]
    with fiber_core.Pool(WORKERS, backend="docker") as pool:
        it = pool.imap_unordered(functools.partial(docker_tasks.logged_task, where=str(where)),
                                 range(N), chunksize=1)
        got = [it.next(WAIT) for _ in range(fault.after)]
        wait_until(lambda: len(serving_containers(pool)) == WORKERS, "every worker is connected")
        worker, container = serving_containers(pool)[fault.worker % WORKERS]
        struck_at = len(got)
        heal = strike(container)
        try:
            # The others go on; the fault lasts while they deliver HEALED_AFTER results.
            got += [it.next(WAIT) for _ in range(HEALED_AFTER)]
            healed_at = len(got)
            if heals:
                heal()
            got += [it.next(WAIT) for _ in range(N - len(got))]
            if not heals:  # the struck worker is lost once its job's end is known
                wait_until(lambda: container in {loss["id"] for loss in pool.status_snapshot()["loss_log"]},
                           "the struck worker's loss is counted")
            snap = pool.status_snapshot()
        finally:
            heal()
    return Outcome(got, struck_at, healed_at, snap, worker, container, runs_per_item(where))


def _check_healed(out: Outcome) -> None:
    assert sorted(x for x, _ in out.got) == list(range(N)), out.snap
    assert out.snap["losses"] == {}, out.snap["last_loss"]  # the struck worker came back: no loss
    assert set(out.runs.values()) == {1}  # not even a task the program cannot see ran twice
    during = [w for _, w in out.got[out.struck_at + WORKERS:out.healed_at]]  # (some were on their way)
    assert out.worker not in during  # the fault held
    assert out.worker in {w for _, w in out.got[out.healed_at:]}  # and the worker came back


def _check_lost(api: docker.APIClient, out: Outcome, reason: EndReason | None = EndReason.UNRESPONSIVE) -> None:
    """Every result once; the struck worker is lost (for ``reason``, if given) and its container removed."""
    assert sorted(x for x, _ in out.got) == list(range(N))  # each result once, though one may have run twice
    assert set(out.runs) == set(range(N))
    ends = {loss["id"]: loss["reason"] for loss in out.snap["loss_log"]}
    assert out.container in ends, out.snap["loss_log"]
    if reason is not None:
        assert ends[out.container] == reason.value, out.snap["loss_log"]
    wait_until(lambda: gone(api, out.container), "the struck worker's container is removed")


# -- a paused container ---------------------------------------------------------------------------


STOPSIGNAL_IMAGE = "fiber-test-stopsignal:faults"
"""The test image with ``STOPSIGNAL SIGINT``: the daemon does not thaw its containers for SIGTERM."""


@pytest.fixture(scope="module")
def stopsignal_image(docker_api: docker.APIClient) -> Iterator[str]:
    dockerfile = f"FROM {IMAGE}\nSTOPSIGNAL SIGINT\n".encode()
    for line in docker_api.build(fileobj=io.BytesIO(dockerfile), tag=STOPSIGNAL_IMAGE, rm=True, decode=True):
        assert "error" not in line, line
    try:
        yield STOPSIGNAL_IMAGE
    finally:
        with contextlib.suppress(docker.errors.APIError):
            docker_api.remove_image(STOPSIGNAL_IMAGE)


@pytest.mark.usefixtures("docker_env")
def test_a_job_terminated_as_soon_as_its_container_runs_ends(docker_api: docker.APIClient) -> None:
    backend = create_backend("docker", "t" + os.urandom(4).hex())
    assert isinstance(backend, DockerBackend)
    try:
        for _ in range(20):
            job = backend.start_job(JobSpec(command=["python3", "-c", "import time; time.sleep(600)"],
                                            name="young"))
            wait_until(lambda: docker_api.inspect_container(job.id)["State"]["Running"],  # noqa: B023
                       "the daemon started it")
            backend.stop_job(job)
            assert backend.wait_for_job(job, WAIT) == -signal.SIGTERM  # not lost
    finally:
        backend.cleanup()


def pause(api: docker.APIClient, container: str) -> None:
    """``docker pause``, again while the cgroup freezer reports that it could not freeze every
    task in time (runc's "unable to freeze", seen on a loaded machine)."""
    def paused() -> bool:
        try:
            api.pause(container)
        except docker.errors.APIError as e:
            if "unable to freeze" not in str(e.explanation):
                raise
            return False
        return True
    wait_until(paused, f"container {container[:12]} is paused")


def _paused_job(backend: DockerBackend, api: docker.APIClient, image: str | None = None) -> Job:
    code = "import time; print('up', flush=True); time.sleep(600)"
    job = backend.start_job(JobSpec(command=["python3", "-c", code], name="paused", image=image))
    # Up, not only started: a signal that reaches the container before its init has set up
    # its signals is lost (see the module's docstring).
    wait_until(lambda: "up" in backend.get_job_logs(job), "its program runs")
    pause(api, job.id)
    return job


@pytest.mark.usefixtures("docker_env")
def test_a_paused_container_is_stopped_and_removed_by_terminate_by_kill_and_at_cleanup(
        docker_api: docker.APIClient) -> None:
    backend = create_backend("docker", "t" + os.urandom(4).hex())
    assert isinstance(backend, DockerBackend)
    try:
        for force, code in ((False, -signal.SIGTERM), (True, -signal.SIGKILL)):
            job = _paused_job(backend, docker_api)
            backend.stop_job(job, force=force)
            assert backend.wait_for_job(job, WAIT) == code  # the daemon thaws it to deliver the signal
            assert job.state.reason is EndReason.STOPPED
            wait_until(functools.partial(gone, docker_api, job.id), "the container is removed")
        job = _paused_job(backend, docker_api)
    finally:
        backend.cleanup()  # a paused container goes with the others
    assert gone(docker_api, job.id)


@pytest.mark.usefixtures("docker_env")
def test_a_paused_container_whose_image_stops_by_another_signal_ends_when_terminated(
        docker_api: docker.APIClient, stopsignal_image: str) -> None:
    backend = create_backend("docker", "t" + os.urandom(4).hex())
    try:
        job = _paused_job(backend, docker_api, stopsignal_image)
        backend.stop_job(job)
        assert backend.wait_for_job(job, WAIT) == -signal.SIGTERM  # thawed by the backend: no hang
        assert job.state.reason is EndReason.STOPPED
    finally:
        backend.cleanup()


def _pause(api: docker.APIClient) -> Fault:
    def strike(container: str) -> Callable[[], None]:
        pause(api, container)

        def heal() -> None:
            with contextlib.suppress(docker.errors.APIError):  # stopped and removed meanwhile
                if api.inspect_container(container)["State"]["Paused"]:
                    api.unpause(container)
        return heal
    return strike


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("docker_env")
def test_a_container_paused_for_good_is_lost_unresponsive_and_every_result_comes_once(
        docker_api: docker.APIClient, task_log: Path) -> None:
    with configured(heartbeat_timeout=3.0):
        out = _faulted_map(docker_api, task_log, _pause(docker_api), heals=False)
    _check_lost(docker_api, out)


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("docker_env")
def test_a_container_paused_shorter_than_the_bound_loses_nothing_and_runs_nothing_twice(
        docker_api: docker.APIClient, task_log: Path) -> None:
    with configured(heartbeat_timeout=WAIT):
        out = _faulted_map(docker_api, task_log, _pause(docker_api), heals=True)
    _check_healed(out)


# -- a container cut off from the master ------------------------------------------------------------


def hub_port() -> int:
    """The TCP port on which this run's hub takes the containers' connections."""
    rt = runtime()
    addresses = rt.addresses_for(rt.get_backend("docker"))
    return int([a for a in addresses.split(",") if a.startswith("tcp:")][0].rsplit(":", 1)[1])


def _partition(api: docker.APIClient, cuts: list[Partition]) -> Fault:
    def strike(container: str) -> Callable[[], None]:
        cut = Partition(api, container, hub_port())
        cuts.append(cut)
        try:
            cut.cut()
        except BaseException:
            cut.heal()
            raise
        return cut.heal
    return strike


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("docker_env")
def test_a_container_cut_off_for_good_is_lost_unresponsive_and_every_result_comes_once(
        docker_api: docker.APIClient, task_log: Path) -> None:
    cuts: list[Partition] = []
    with configured(heartbeat_timeout=3.0):
        out = _faulted_map(docker_api, task_log, _partition(docker_api, cuts), heals=False)
    _check_lost(docker_api, out)
    assert cuts[0].dropped, "the partition dropped nothing"


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("docker_env")
def test_a_partition_that_heals_within_the_bound_loses_nothing_and_runs_nothing_twice(
        docker_api: docker.APIClient, task_log: Path) -> None:
    cuts: list[Partition] = []
    with configured(heartbeat_timeout=WAIT):
        out = _faulted_map(docker_api, task_log, _partition(docker_api, cuts), heals=True)
    _check_healed(out)
    assert cuts[0].dropped, "the partition dropped nothing"


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("docker_env")
def test_with_heartbeats_off_a_container_cut_off_for_good_is_lost_after_peer_timeout(
        docker_api: docker.APIClient, task_log: Path) -> None:
    """Unlike a paused container, a cut-off one does not answer TCP keepalive: ``peer_timeout``
    ends its connections (whichever side sees it first: the worker leaves, or is stopped)."""
    cuts: list[Partition] = []
    with configured(heartbeat_timeout=0, peer_timeout=4):
        out = _faulted_map(docker_api, task_log, _partition(docker_api, cuts), heals=False)
    _check_lost(docker_api, out, reason=None)
    assert cuts[0].dropped, "the partition dropped nothing"
