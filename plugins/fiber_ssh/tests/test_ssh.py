"""fiber-ssh against real sshd hosts: three network namespaces made by scripts/services/ssh.sh.

Each host (fiber-h1..3 on 10.231.77.0/24) runs its own sshd with its own host key and
hostname, and has its own /tmp; this machine is 10.231.77.1 on their bridge. Nothing is
mocked: paramiko logs in over TCP, the jobs are real processes in the namespaces and reach
this process over the bridge. The namespaces share the rest of the filesystem, so the
remote Python is this test's own interpreter (``sys.executable``).

The hosts are started by ``bash scripts/test-services.sh up ssh`` (CI does it); when they
are not up and this process is root, the tests start them and stop them at the end.
Without root they cannot exist, and the tests skip saying so.
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import json
import logging
import multiprocessing.process
import os
import re
import select
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fiber_core
import fiber_core.runtime.run
import pytest
from fiber_core.base.errors import BackendError, ConfigError
from fiber_core.contract import HOST_LOST_EXITCODE, EndReason
from fiber_core.contract.backend import Backend, Job, JobSpec
from fiber_core.runtime.config import config, create_backend, plugins
from fiber_core.testing import BackendConformance, failing_program
from fiber_core.testing.faults import SEED_VARIABLE, FaultSchedule, chaos_seed

from fiber_ssh.backend import SshBackend

REPO = Path(__file__).resolve().parents[3]
SERVICES = Path(os.environ.get("FIBER_SERVICES_DIR", "/tmp/fiber-services"))
ENV_FILE = SERVICES / "ssh" / "hosts.env"
NAMES = ["fiber-h1", "fiber-h2", "fiber-h3"]
T = 60.0
"""Bound of every wait (a test that needs it has failed: it is never a measure of speed)."""

pytestmark = pytest.mark.timeout(240)


def _read_env(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = shlex.split(value)[0] if value.strip() else ""
    return out


@pytest.fixture(scope="session")
def hosts() -> Iterator[dict[str, str]]:
    """The facts of hosts.env, the hosts brought up first if they are not."""
    if os.geteuid() != 0:
        pytest.skip("the SSH test hosts are network namespaces: creating them needs root")
    started = False
    if not ENV_FILE.exists():
        up = subprocess.run(["bash", str(REPO / "scripts/test-services.sh"), "up", "ssh"],
                            capture_output=True, text=True, timeout=600)
        if up.returncode != 0:
            pytest.fail(f"could not start the SSH test hosts:\n{up.stdout}\n{up.stderr}")
        started = True
    try:
        yield _read_env(ENV_FILE)
    finally:
        if started:
            subprocess.run(["bash", str(REPO / "scripts/test-services.sh"), "down", "ssh"],
                           capture_output=True, timeout=120)


def ssh_env(hosts: dict[str, str], slots: int = 2, **extra: str) -> dict[str, str]:
    """FIBER_* variables that select the ssh backend on the test hosts."""
    env = {
        "FIBER_BACKEND": "ssh",
        "FIBER_SSH_HOSTS": ", ".join(f"{h}*{slots}" for h in hosts["FIBER_SSH_HOSTS"].split()),
        "FIBER_SSH_USER": hosts["FIBER_SSH_USER"],
        "FIBER_SSH_KEY": hosts["FIBER_SSH_KEY"],
        "FIBER_SSH_KNOWN_HOSTS": hosts["FIBER_SSH_KNOWN_HOSTS"],
        "FIBER_SSH_PYTHON": sys.executable,
        "FIBER_SSH_SSH_CONFIG": "",
    }
    env.update({f"FIBER_SSH_{k.upper()}": v for k, v in extra.items()})
    return env


@contextlib.contextmanager
def fresh_runtime(env: dict[str, str]) -> Iterator[fiber_core.runtime.run.Runtime]:
    """A new Fiber runtime whose default backend is ssh, configured by ``env``.

    A runtime keeps one instance of each backend for the life of the process: its
    settings, its connections and the hosts it lost. The tests that start Fiber
    processes each get a runtime of their own, so that what one test configures or
    breaks does not reach the next; the previous runtime is put back afterwards.
    """
    saved = fiber_core.runtime.run._runtime
    saved_key = multiprocessing.process.current_process().authkey
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("FIBER_")
                    and k not in ("FIBER_SERVICES_DIR", SEED_VARIABLE)]:
            mp.delenv(key)
        for key, value in env.items():
            mp.setenv(key, value)
        config.reset()
        fiber_core.runtime.run._runtime = None
        rt = fiber_core.runtime.run.runtime()
        try:
            yield rt
        finally:
            rt.shutdown()
            fiber_core.runtime.run._runtime = saved
            multiprocessing.process.current_process().authkey = saved_key
            config.reset()


@pytest.fixture(scope="module")
def ssh_runtime(hosts: dict[str, str]) -> Iterator[fiber_core.runtime.run.Runtime]:
    with fresh_runtime(ssh_env(hosts)) as rt:
        yield rt


def settings(facts: dict[str, str], **overrides: Any) -> dict[str, Any]:
    """Resolved ssh settings for the test hosts, with ``overrides``."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in ssh_env(facts).items():
            mp.setenv(key, value)
        config.reset()
        plugins().backends()
        out = config.backend_settings("ssh")
    config.reset()
    out.update(overrides)
    return out


@pytest.fixture
def make_backend(hosts: dict[str, str]) -> Iterator[Any]:
    """``make_backend(**settings)``: an SshBackend on the test hosts, cleaned up after the test."""
    made: list[SshBackend] = []

    def make(**overrides: Any) -> SshBackend:
        b = SshBackend(settings(hosts, **overrides), "t" + os.urandom(4).hex())
        made.append(b)
        return b

    yield make
    for b in made:
        b.cleanup()


def ctl(hosts: dict[str, str], action: str, host: str) -> None:
    subprocess.run(["bash", hosts["FIBER_SSH_CTL"], action, host], check=True, timeout=60)


def py(code: str, **kw: Any) -> JobSpec:
    return JobSpec(command=[sys.executable, "-c", textwrap.dedent(code)], name="test", **kw)


def run_processes(netns: str, run_id: str) -> list[str]:
    """``pid command`` of every process in ``netns`` that belongs to the Fiber run ``run_id``."""
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout
    found = []
    for pid in out.split():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue  # ended meanwhile
        if f"FIBER_RUN_ID={run_id}".encode() in environ.split(b"\0") or \
                b"\0fiber-ssh\0" + run_id.encode() in cmdline:
            shown = cmdline.replace(b"\0", b" ").decode(errors="replace")[:100]
            found.append(f"{pid} {shown}")
    return found


def wait_until_gone(run_id: str, netns: list[str] = NAMES) -> list[str]:
    """Wait (bounded) until no process of the run is left on the hosts; return what is left."""
    deadline = time.monotonic() + T
    while True:
        left = [f"{ns}: {p}" for ns in netns for p in run_processes(ns, run_id)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


@contextlib.contextmanager
def private_sshd(hosts: dict[str, str], tmp_path: Path, port: int, config: str = "",
                 cgroup: Path | None = None) -> Iterator[str]:
    """An sshd of the test's own in fiber-h1's network namespace, on ``port``; yields its host entry.

    It shares this machine's /tmp (not the host's own) and /sys, takes ``config`` as
    extra sshd_config lines, and starts in ``cgroup`` when given (its sessions too).
    """
    keydir = SERVICES / "ssh" / "fiber-h1"
    config_file = tmp_path / f"sshd_config_{port}"
    pidfile = tmp_path / f"sshd_{port}.pid"
    addr = hosts["FIBER_SSH_HOSTS"].split()[0]
    config_file.write_text(textwrap.dedent(f"""
        ListenAddress {addr}:{port}
        HostKey {keydir}/ssh_host_ed25519_key
        PidFile {pidfile}
        AuthorizedKeysFile {SERVICES}/ssh/authorized_keys
        PermitRootLogin prohibit-password
        PasswordAuthentication no
        KbdInteractiveAuthentication no
        UsePAM no
        StrictModes no
        UseDNS no
    """) + textwrap.dedent(config))
    # nsenter, not ip netns exec, which mounts a sysfs of its own without /sys/fs/cgroup
    log_file = tmp_path / f"sshd_{port}.log"
    sshd = ["nsenter", "--net=/run/netns/fiber-h1", "/usr/sbin/sshd", "-D", "-f", str(config_file),
            "-E", str(log_file)]
    if cgroup is not None:  # the shell joins the cgroup, then becomes sshd
        sshd = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs"), *sshd]
    # In the foreground (-D): its pid is known at once, so it is stopped even if the test ends
    # before it listens (a daemon's pid file may not be written yet, and it would stay).
    proc = subprocess.Popen(sshd)
    try:
        deadline = time.monotonic() + T
        while not _accepts(addr, port) or proc.poll() is not None:
            assert proc.poll() is None, f"sshd on port {port} ended: {log_file.read_text()[-500:]}"
            assert time.monotonic() < deadline, f"sshd on port {port} does not listen within {T} s"
            time.sleep(0.05)
        yield f"{addr}:{port}"
    finally:
        proc.terminate()
        proc.wait(T)


def _accepts(addr: str, port: int) -> bool:
    try:
        socket.create_connection((addr, port), timeout=T).close()
        return True
    except ConnectionRefusedError:
        return False


@contextlib.contextmanager
def memory_cgroup(limit_mib: int) -> Iterator[Path]:
    """A new memory cgroup (v2, else v1) limited to ``limit_mib``; what runs in it is killed at the end."""
    name = "fiber-ssh-test-" + os.urandom(4).hex()
    root = Path("/sys/fs/cgroup")
    if (root / "cgroup.subtree_control").exists() and \
            "memory" in (root / "cgroup.subtree_control").read_text().split():
        path, limit_file = root / name, "memory.max"
    elif (root / "memory" / "memory.limit_in_bytes").exists():
        path, limit_file = root / "memory" / name, "memory.limit_in_bytes"
    else:
        pytest.skip("this machine has no memory cgroup controller to limit an sshd with")
    try:
        path.mkdir()
    except OSError as e:
        pytest.skip(f"cannot create a memory cgroup here ({e})")
    try:
        (path / limit_file).write_text(str(limit_mib << 20))
        yield path
    finally:
        deadline = time.monotonic() + T
        while (pids := (path / "cgroup.procs").read_text().split()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.05)
        path.rmdir()


# -- the shared contract ------------------------------------------------------------------


class TestSsh(BackendConformance):
    backend_name = "ssh"
    python = sys.executable
    start_timeout = T

    @pytest.fixture
    def backend(self, ssh_runtime: fiber_core.runtime.run.Runtime) -> Iterator[Backend]:
        b = create_backend("ssh", "conf" + os.urandom(4).hex())
        try:
            yield b
        finally:
            b.cleanup()


def test_installed_and_registered() -> None:
    info = {b.name: b for b in plugins().backends()}["ssh"]
    assert info.cls is SshBackend
    assert info.package == "fiber-ssh"


# -- jobs on hosts ----------------------------------------------------------------------------


def test_jobs_run_in_their_own_group_on_the_host_that_has_most_free_slots(make_backend: Any) -> None:
    b = make_backend()
    code = """
        import os, socket, subprocess, time
        child = subprocess.Popen(["/bin/sleep", "600"])
        print("up", socket.gethostname(), os.getpid(), os.getpgid(0), os.getsid(0),
              os.getpgid(child.pid), flush=True)
        time.sleep(600)
    """
    jobs = [b.start_job(py(code)) for _ in range(3)]
    facts = []
    for job in jobs:
        deadline = time.monotonic() + T
        while not re.search(r"^up .*\n", b.get_job_logs(job), re.M):
            assert b.poll_job(job) is None, b.get_job_logs(job)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        facts.append(b.get_job_logs(job).split()[1:])
    assert sorted(f[0] for f in facts) == NAMES  # one per host: each had the most free slots
    for job, (host, pid, pgid, sid, child_pgid) in zip(jobs, facts):
        assert pid == pgid == sid == child_pgid == str(job.handle.pgid)
        assert job.host == host
    b.kill_job(jobs[0])
    assert b.wait_for_job(jobs[0], T) == -signal.SIGKILL


def test_exit_codes_of_signals_from_inside(make_backend: Any) -> None:
    b = make_backend()
    job = b.start_job(py("import os, signal; os.kill(os.getpid(), signal.SIGUSR1)"))
    assert b.wait_for_job(job, T) == -signal.SIGUSR1
    job = b.start_job(JobSpec(command=["/nonexistent/program"], name="x"))
    assert b.wait_for_job(job, T) == 127
    assert "cannot start '/nonexistent/program'" in b.get_job_logs(job)


def job_pid(b: Any, job: Job) -> int:
    """The pid a job prints first (``pid N``), polled from its log."""
    deadline = time.monotonic() + T
    while not re.search(r"^pid \d+\n", b.get_job_logs(job), re.M):
        assert b.poll_job(job) is None, b.get_job_logs(job)
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return int(b.get_job_logs(job).split()[1])


def test_why_jobs_end(make_backend: Any) -> None:
    b = make_backend()
    job = b.start_job(py("pass"))
    assert b.wait_for_job(job, T) == 0
    assert b.end_reason(job) is EndReason.EXITED
    # Killed on the host by someone else: the program's (or the system's) doing.
    job = b.start_job(py("import os, time; print('pid', os.getpid(), flush=True); time.sleep(600)"))
    os.kill(job_pid(b, job), signal.SIGKILL)  # the hosts share our pids
    assert b.wait_for_job(job, T) == -signal.SIGKILL
    assert b.end_reason(job) is EndReason.EXITED
    # Stopped by Fiber.
    job = b.start_job(py("import time; print('up', flush=True); time.sleep(600)"))
    deadline = time.monotonic() + T
    while "up" not in b.get_job_logs(job):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    b.stop_job(job)
    assert b.wait_for_job(job, T) == -signal.SIGTERM
    assert b.end_reason(job) is EndReason.STOPPED
    # An interpreter the host does not have.
    job = b.start_job(JobSpec(command=["/opt/no/python3", "-c", "pass"], name="x"))
    assert b.wait_for_job(job, T) == 127
    assert b.end_reason(job) is EndReason.NEVER_STARTED
    assert job.handle.host.name in job.state.detail and "/opt/no/python3" in job.state.detail


def test_supervisor_that_cannot_run_never_started(make_backend: Any, hosts: dict[str, str],
                                                  tmp_path: Path) -> None:
    """The Python of [ssh] python gone after the connection checked it: the job never starts."""
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} \"$@\"\n")
    python.chmod(0o755)
    with private_sshd(hosts, tmp_path, 2223) as host:
        b = make_backend(hosts=host, known_hosts=str(tmp_path / "known_hosts"),
                         host_key_policy="accept-new", python=str(python))
        assert b.wait_for_job(b.start_job(py("pass")), T) == 0
        python.unlink()
        job = b.start_job(py("pass"))
        assert b.wait_for_job(job, T) == 127
        assert b.end_reason(job) is EndReason.NEVER_STARTED
        assert "the job supervisor on root@" in job.state.detail
        assert str(python) in b.get_job_logs(job)  # what the host's shell said


def test_out_of_memory_kill_on_the_host(make_backend: Any, hosts: dict[str, str], tmp_path: Path) -> None:
    """A host whose sshd sessions live in a memory-limited cgroup: the job outgrows it."""
    with memory_cgroup(256) as cgroup, private_sshd(hosts, tmp_path, 2224, cgroup=cgroup) as host:
        b = make_backend(hosts=host, known_hosts=str(tmp_path / "known_hosts"),
                         host_key_policy="accept-new")
        job = b.start_job(py("""
            held = []
            while True:
                held.append(b"x" * (16 << 20))
        """))
        assert b.wait_for_job(job, T) == -signal.SIGKILL, b.get_job_logs(job)
        assert b.end_reason(job) is EndReason.OOM
        assert "out-of-memory killer ended the job on root@" in b.get_job_logs(job)
        fine = b.start_job(py("pass"))
        assert b.wait_for_job(fine, T) == 0
        assert b.end_reason(fine) is EndReason.EXITED
        # A SIGKILL from someone on the host while the cgroup's count stands still: not for memory.
        killed = b.start_job(py("import os, time; print('pid', os.getpid(), flush=True); time.sleep(600)"))
        os.kill(job_pid(b, killed), signal.SIGKILL)  # the hosts share our pids
        assert b.wait_for_job(killed, T) == -signal.SIGKILL
        assert b.end_reason(killed) is EndReason.KILLED, killed.state.detail
        assert "not by the out-of-memory killer" in killed.state.detail
        b.cleanup()  # before the cgroup goes


def test_connections_give_up_within_peer_timeout(make_backend: Any) -> None:
    """A silent host is lost after keepalive x (1 + keepalive_count) s, or peer_timeout if shorter."""
    for peer_timeout, expected_ms in ((30.0, 4000), (2.0, 2000)):
        b = make_backend(keepalive=1.0, keepalive_count=3)
        b.peer_timeout = peer_timeout
        job = b.start_job(py("pass"))
        assert b.wait_for_job(job, T) == 0
        sock = job.handle.transport.sock
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == expected_ms


def test_pool_spreads_over_the_three_hosts(ssh_runtime: Any) -> None:
    arrived, go = fiber_core.Queue(), fiber_core.Queue()
    with fiber_core.Pool(6) as pool:
        result = pool.map_async(functools.partial(_meet, arrived=arrived, go=go), range(6), chunksize=1)
        # Every task waits for the others: six tasks hold the six workers at once.
        met = sorted(arrived.get(timeout=T) for _ in range(6))
        for _ in range(6):
            go.put(None)
        names = result.get(T)
    assert sorted(set(met)) == NAMES
    assert sorted(names) == met
    many = fiber_core.Pool(6)
    try:
        assert many.map(_square, range(500)) == [x * x for x in range(500)]
    finally:
        many.terminate()


def test_broadcast_crosses_the_network_once_per_host_and_version(ssh_runtime: Any) -> None:
    np = pytest.importorskip("numpy")

    table = fiber_core.broadcast(np.full(1 << 20, 1.0, dtype=np.float32))  # 4 MiB
    arrived, go = fiber_core.Queue(), fiber_core.Queue()
    with fiber_core.Pool(6) as pool:
        for version in (1, 2):
            if version == 2:
                table.publish(np.full(1 << 20, 2.0, dtype=np.float32))
            # Every task waits for the others: all six workers, two per host, read.
            result = pool.map_async(functools.partial(_read_broadcast, table=table, arrived=arrived, go=go),
                                    range(6), chunksize=1)
            for _ in range(6):
                arrived.get(timeout=T)
            for _ in range(6):
                go.put(None)
            seen = result.get(T)
            assert sorted({host for host, *_ in seen}) == NAMES
            assert {(v, values, shared) for _, v, values, shared, _ in seen} == {(version, (float(version),), True)}
            for name in NAMES:  # the two readers of a host map one segment
                assert len({segment for host, *_, segment in seen if host == name}) == 1
            assert table.fetches == 3 * version


def _read_broadcast(x: int, table: Any, arrived: Any, go: Any) -> tuple:
    import numpy as np

    arr = table.value
    address = arr.__array_interface__["data"][0]
    segment = None
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            if lo <= address < hi and len(fields) >= 6:
                segment = (fields[5], int(fields[4]))
    arrived.put(x)
    go.get(timeout=T)
    return socket.gethostname(), table.version, tuple(float(v) for v in np.unique(arr)), table.shared, segment


def _ms_task(x: int) -> int:
    time.sleep(0.001 + (x % 5) * 0.001)  # 1-5 ms
    return x


def _run_workers(run_id: str) -> list[int]:
    """The pids of this run's workers on the three hosts (network namespaces share our pids)."""
    found = [line.split(maxsplit=1) for name in NAMES for line in run_processes(name, run_id)]
    return [int(pid) for pid, cmd in found if "fiber_core.processes.worker" in cmd]


@pytest.mark.timeout(600)
def test_pool_map_under_preemption_charges_no_task(ssh_runtime: Any) -> None:
    """A worker sent SIGTERM, then SIGKILL 2 s later if it still runs (a preemption with
    notice), at 20 points of a map over the three hosts that a seed draws (FIBER_CHAOS_SEED
    replays them): every result exactly once and in order, and no task charged
    (``task_losses=1``: one charged death fails it)."""
    import threading

    n = 6000
    schedule = FaultSchedule.spread(chaos_seed(default=7), results=n, count=20, kinds=("term",))
    stop = threading.Event()
    hit: list[int] = []

    def preempt(pool: fiber_core.Pool) -> None:
        while schedule.left and not stop.wait(0.002):
            for fault in schedule.due(pool._tasks_done):
                pids = sorted(p for p in _run_workers(ssh_runtime.run_id) if p not in hit)
                if not pids:
                    continue
                pid = pids[fault.worker % len(pids)]
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
                    hit.append(pid)
                    threading.Timer(2.0, _kill_quietly, args=(pid,)).start()

    with fiber_core.Pool(6, task_losses=1) as pool:
        thread = threading.Thread(target=preempt, args=(pool,), daemon=True)
        thread.start()
        try:
            out = pool.map(_ms_task, range(n), chunksize=5)
        finally:
            stop.set()
            thread.join(T)
        assert out == list(range(n)), schedule
        assert pool.map(_square, range(8)) == [x * x for x in range(8)]
    assert hit, f"no worker was preempted during the map ({schedule})"


def _kill_quietly(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _meet(x: int, arrived: Any, go: Any) -> str:
    arrived.put(socket.gethostname())
    go.get(timeout=T)
    return socket.gethostname()


def _square(x: int) -> int:
    return x * x


def test_gpu_jobs_get_their_gpus_and_impossible_ones_fail_clearly(make_backend: Any,
                                                                   hosts: dict[str, str]) -> None:
    h1, h2, _ = hosts["FIBER_SSH_HOSTS"].split()
    b = make_backend(hosts=f"{h1}*4[gpu=2,gpu_type=a10g], {h2}*8")
    show = "import os, socket; print(socket.gethostname(), os.environ.get('CUDA_VISIBLE_DEVICES'))"
    jobs = [b.start_job(py(show, gpu=1, gpu_type="a10g")) for _ in range(2)]
    jobs.append(b.start_job(py(show, gpu=-1)))
    jobs.append(b.start_job(py(show)))
    for job in jobs:
        assert b.wait_for_job(job, T) == 0, b.get_job_logs(job)
    assert [b.get_job_logs(j).split() for j in jobs] == [
        ["fiber-h1", "0"], ["fiber-h1", "1"], ["fiber-h1", "0,1"], ["fiber-h2", "None"]]
    with pytest.raises(BackendError, match=rf"1 GPU\(s\) of type 'v100'.*root@{re.escape(h1)} \(2x a10g\)"):
        b.start_job(py(show, gpu=1, gpu_type="v100"))


def _put_resources(q: Any) -> None:
    q.put(json.dumps(fiber_core.current_process().resources))


GOT = "import os, time; print('GOT', os.environ['FIBER_RESOURCES'], flush=True); time.sleep(60)"


def _record(b: Any, job: Job) -> dict[str, Any]:
    """The resource record a job printed (it waits until the job has printed it)."""
    deadline = time.monotonic() + T
    while "GOT " not in b.get_job_logs(job):
        assert time.monotonic() < deadline and b.poll_job(job) is None, b.get_job_logs(job)
        time.sleep(0.02)  # the output arrives on the job's channel: nothing to wait on here
    line = next(ln for ln in b.get_job_logs(job).splitlines() if ln.startswith("GOT "))
    return json.loads(line.split(" ", 1)[1])


def test_jobs_go_to_the_first_gpu_alternative_with_free_room(make_backend: Any, hosts: dict[str, str]) -> None:
    h1, h2, h3 = hosts["FIBER_SSH_HOSTS"].split()
    b = make_backend(hosts=f"{h1}*2[gpu=1,gpu_type=a100,cost=4], {h2}*4[gpu=2,gpu_type=l4,cost=1.5], {h3}*8")
    jobs = [b.start_job(py(GOT, gpu_type=["a100", ("l4", 2)])) for _ in range(3)]
    got = [(j.host, *(_record(b, j)[k] for k in ("gpu_type", "gpu", "cost_per_hour"))) for j in jobs]
    # The A100 first; then two L4s; then no alternative has free room: the A100 again, shared.
    assert got == [("fiber-h1", "a100", 1, 4.0), ("fiber-h2", "l4", 2, 1.5), ("fiber-h1", "a100", 1, 4.0)]
    cpu = b.start_job(py(GOT))
    assert _record(b, cpu) == {"gpu_type": None, "gpu": 0, "capacity": None, "cost_per_hour": None}
    assert cpu.host == "fiber-h3"
    for job in [*jobs, cpu]:
        b.stop_job(job, force=True)


def test_a_process_knows_the_gpu_alternative_host_and_cost_it_got(hosts: dict[str, str]) -> None:
    h1, h2, _ = hosts["FIBER_SSH_HOSTS"].split()
    env = {**ssh_env(hosts), "FIBER_SSH_HOSTS": f"{h1}*2, {h2}*2[gpu=2,gpu_type=l4,cost=1.5]", "FIBER_SPARE_JOBS": "0"}
    with fresh_runtime(env):
        q = fiber_core.Queue()
        p = fiber_core.Process(target=_put_resources, args=(q,), gpu_type=["h100", "l4"])
        p.start()
        got = json.loads(q.get(timeout=T))
        p.join(T)
    assert p.exitcode == 0
    assert got == {"gpu_type": "l4", "gpu": 1, "capacity": None, "cost_per_hour": 1.5, "host": "fiber-h2"}


def test_upload_copies_the_working_directory(make_backend: Any, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "helper_mod.py").write_text("VALUE = 42\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.txt").write_text("payload")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "junk.pyc").write_bytes(b"x")
    monkeypatch.chdir(tmp_path)
    b = make_backend(upload=True)
    job = b.start_job(py("""
        import os, helper_mod
        print(helper_mod.VALUE, open("data/x.txt").read(), os.path.exists("__pycache__/junk.pyc"), os.getcwd())
    """))
    assert b.wait_for_job(job, T) == 0, b.get_job_logs(job)
    value, text, junk, cwd = b.get_job_logs(job).split()
    assert (value, text, junk) == ("42", "payload", "False")
    assert cwd != str(tmp_path) and not Path(cwd).exists()  # it is on the host's own /tmp
    host = job.handle.host
    b.cleanup()
    check = make_backend()
    probe = check.start_job(py(f"import os; print(os.path.exists({cwd!r}))"))
    assert check.wait_for_job(probe, T) == 0
    assert probe.host == host.hostname  # both went to the first host: it had the most free slots
    assert check.get_job_logs(probe).split() == ["False"]


def test_an_upload_that_failed_is_tried_again_and_leaves_nothing(make_backend: Any, hosts: dict[str, str],
                                                                 tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "data.txt").write_text("payload")
    (tmp_path / "unreadable").symlink_to("/proc/self/mem")  # a file whose read fails (EIO)
    monkeypatch.chdir(tmp_path)
    first = hosts["FIBER_SSH_HOSTS"].split()[0]  # one host: every backend here sees its /tmp
    b = make_backend(upload=True, hosts=first)
    with pytest.raises(BackendError, match=r"uploading .* failed"):
        b.start_job(py("pass"))
    (tmp_path / "unreadable").unlink()
    job = b.start_job(py("print(open('data.txt').read())"))  # in the directory the first try made
    assert b.wait_for_job(job, T) == 0, b.get_job_logs(job)
    assert b.get_job_logs(job).split() == ["payload"]
    b.cleanup()
    check = make_backend(hosts=first)
    probe = check.start_job(py(f"import glob; print(len(glob.glob('/tmp/fiberupload-{b.run_id}-*')))"))
    assert check.wait_for_job(probe, T) == 0
    assert check.get_job_logs(probe).split() == ["0"]


def test_more_connections_when_sshd_limits_sessions(make_backend: Any, hosts: dict[str, str],
                                                    tmp_path: Path) -> None:
    """OpenSSH allows 10 sessions per connection by default: past that, another connection."""
    with private_sshd(hosts, tmp_path, 2222, "MaxSessions 2") as host:
        b = make_backend(hosts=f"{host}*8", known_hosts=str(tmp_path / "known_hosts"),
                         host_key_policy="accept-new")
        jobs = [b.start_job(py("import time; print('up', flush=True); time.sleep(600)"))
                for _ in range(5)]
        for job in jobs:
            deadline = time.monotonic() + T
            while "up" not in b.get_job_logs(job):
                assert b.poll_job(job) is None, b.get_job_logs(job)
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert len({id(j.handle.transport) for j in jobs}) >= 3
        addr = host.split(":")[0]
        assert f"[{addr}]:2222 ssh-ed25519" in (tmp_path / "known_hosts").read_text()


# -- clear errors -------------------------------------------------------------------------------


def test_changed_host_key_is_an_error_naming_the_host(make_backend: Any, hosts: dict[str, str],
                                                      tmp_path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")],
                   check=True)
    other = (tmp_path / "other.pub").read_text().split()[:2]
    known = tmp_path / "known_hosts"
    lines = Path(hosts["FIBER_SSH_KNOWN_HOSTS"]).read_text().splitlines()
    first = hosts["FIBER_SSH_HOSTS"].split()[0]
    known.write_text("\n".join(f"{first} {' '.join(other)}" if line.startswith(first + " ") else line
                               for line in lines) + "\n")
    b = make_backend(known_hosts=str(known), host_key_policy="accept-new")
    with pytest.raises(BackendError, match=rf"host key of root@{re.escape(first)} has CHANGED"):
        b.start_job(py("pass"))


def test_unknown_host_key_strict_by_default_accepted_on_request(make_backend: Any, hosts: dict[str, str],
                                                               tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    with pytest.raises(BackendError, match=r"host key of root@10\.231\.77\.1\d is unknown.*accept-new"):
        make_backend(known_hosts=str(known)).start_job(py("pass"))
    b = make_backend(known_hosts=str(known), host_key_policy="accept-new")
    assert b.wait_for_job(b.start_job(py("pass")), T) == 0
    assert len(known.read_text().splitlines()) == 3
    strict = make_backend(known_hosts=str(known))
    assert strict.wait_for_job(strict.start_job(py("pass")), T) == 0


def test_refused_login_names_user_and_host(make_backend: Any) -> None:
    with pytest.raises(BackendError, match=r"refused the login as 'nobody-here'.*tried: /"):
        make_backend(user="nobody-here").start_job(py("pass"))


def test_missing_python_or_fiber_core(make_backend: Any) -> None:
    with pytest.raises(BackendError, match=r"Python '/opt/no/python3' is not found on root@10\.231\.77"):
        make_backend(python="/opt/no/python3").start_job(py("pass"))
    with pytest.raises(BackendError, match=r"fiber-core is not installed for /usr/bin/python3 on root@") as e:
        make_backend(python="/usr/bin/python3").start_job(py("pass"))
    # A command that works there: the wheels of this checkout, not a name no index serves.
    assert re.search(r"install it there: build the wheels: bash \S*scripts/build-dists\.sh fiber-dist here, copy "
                     r"fiber-dist to the host, and there run: /usr/bin/python3 -m pip install --find-links "
                     r"fiber-dist fiber-core$", str(e.value)), str(e.value)


def test_process_start_raises_the_clear_error(hosts: dict[str, str]) -> None:
    with fresh_runtime(ssh_env(hosts, python="/opt/no/python3")):
        p = fiber_core.Process(target=_square, args=(2,))
        with pytest.raises(BackendError, match="Python '/opt/no/python3' is not found"):
            p.start()
    with fresh_runtime({**ssh_env(hosts), "FIBER_SSH_HOSTS": ""}):
        with pytest.raises(ConfigError, match="no SSH hosts configured"):
            fiber_core.Process(target=_square, args=(2,)).start()


def test_unreachable_or_missing_hosts_read_at_a_glance(tmp_path: Path) -> None:
    """What `FIBER_BACKEND=ssh python app.py` prints when no host answers, or none is configured: the
    program's frame first, one line that says what to check, and no warning or chain above it."""
    with socket.socket() as s:  # a port of this machine where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FIBER_", "SSH_"))}
    env.update(FIBER_BACKEND="ssh", HOME=str(tmp_path))
    for hosts, says in ((f"127.0.0.1:{port}", "fiber_core.base.errors.BackendError: no SSH host is reachable. "
                         "Check that the hosts are up and run sshd, and the [ssh] hosts setting "
                         f"(FIBER_SSH_HOSTS): {getpass.getuser()}@127.0.0.1:{port}: cannot connect"),
                        ("", "fiber_core.base.errors.ConfigError: no SSH hosts configured: set [ssh] hosts")):
        line, stderr = failing_program(tmp_path, {**env, "FIBER_SSH_HOSTS": hosts}, timeout=T)
        assert line.startswith(says), stderr


# -- failures -----------------------------------------------------------------------------------


@pytest.fixture
def heal(hosts: dict[str, str]) -> Iterator[list[tuple[str, str]]]:
    """Undo at the end whatever the test did to a host: ``heal.append(("heal", "h1"))``."""
    undo: list[tuple[str, str]] = []
    yield undo
    for action, host in undo:
        ctl(hosts, action, host)


def _hold_on_h1(x: int, started: Any, gate: Any) -> tuple[int, str]:
    name = socket.gethostname()
    if name == "fiber-h1":
        started.put(x)
        time.sleep(600)  # until the cut host's supervisor kills it
    else:  # wait until the test opens the gate (after a task started on fiber-h1)
        gate.put(gate.get(timeout=T))
    return x, name


def test_host_cut_off_mid_map_every_result_once(hosts: dict[str, str], heal: list) -> None:
    env = ssh_env(hosts, orphan_timeout="5")
    with fresh_runtime(env) as rt:
        started, gate = fiber_core.Queue(), fiber_core.Queue()
        pool = fiber_core.Pool(6)
        try:
            # The workers of fiber-h2 and -h3 hold their first task at the gate, so fiber-h1's
            # workers get tasks too, whenever they come up; those tasks never end there.
            task = functools.partial(_hold_on_h1, started=started, gate=gate)
            results = pool.imap_unordered(task, range(60), chunksize=1)
            started.get(timeout=T)  # a task is running on fiber-h1
            heal.append(("heal", "fiber-h1"))
            ctl(hosts, "cut", "fiber-h1")
            gate.put(True)
            got = [results.next(T) for _ in range(60)]
        finally:
            pool.terminate()
        assert sorted(x for x, _ in got) == list(range(60))
        assert {name for _, name in got} <= {"fiber-h2", "fiber-h3"}
        run_id = rt.run_id
    # Cut off from this process, the supervisors on fiber-h1 end their jobs by themselves.
    assert wait_until_gone(run_id, ["fiber-h1"]) == []


def _borrow_then_hold(q: Any, report: Any, release: Any) -> None:
    taken = [q.get(timeout=T) for _ in range(100)]
    held = len(q._borrower.items) if q._borrower is not None else 0  # lent, not yet taken
    q.qsize()  # returns once the owner has the acknowledgements of what was taken
    report.put((taken, held, socket.gethostname()))
    release.get()


def test_items_lent_to_a_host_that_is_cut_off_come_back(hosts: dict[str, str], heal: list) -> None:
    # The cut host sends no FIN: its connections end by peer_timeout, and the queue's owner
    # then takes back what it had lent there.
    env = ssh_env(hosts, orphan_timeout="5")
    env["FIBER_PEER_TIMEOUT"] = "3"
    with fresh_runtime(env):
        q, report, release = fiber_core.Queue(), fiber_core.Queue(), fiber_core.Queue()
        n = 3000
        for i in range(n):
            q.put(i)
        p = fiber_core.Process(target=_borrow_then_hold, args=(q, report, release))
        p.start()
        taken, held, host = report.get(timeout=T)
        assert held > 0
        heal.append(("heal", host))
        ctl(hosts, "cut", host)
        rest = [q.get(timeout=T) for _ in range(n - len(taken))]
        assert sorted(taken + rest) == list(range(n))  # nothing lost, nothing twice
        p.join(T)
        assert p.exitcode is not None and p.exitcode != 0


def test_host_whose_sshd_is_down_is_skipped(hosts: dict[str, str], heal: list, make_backend: Any) -> None:
    heal.append(("start-sshd", "fiber-h2"))
    ctl(hosts, "kill-sshd", "fiber-h2")
    b = make_backend()
    jobs = [b.start_job(py("import socket; print(socket.gethostname())")) for _ in range(4)]
    for job in jobs:
        assert b.wait_for_job(job, T) == 0
    assert sorted(b.get_job_logs(j).strip() for j in jobs) == ["fiber-h1", "fiber-h1", "fiber-h3", "fiber-h3"]
    assert "fiber-h2" not in {j.host for j in jobs}


def kill_all_sshd(netns: str) -> None:
    """Kill every sshd of a host, the sessions too: as if sshd crashed or the host shut down."""
    pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()
    for pid in pids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip().startswith("sshd"):
                os.kill(int(pid), signal.SIGKILL)


@pytest.mark.parametrize("how", ["cut", "sshd dies"])
def test_lost_host_ends_its_jobs_is_skipped_then_revived(hosts: dict[str, str], heal: list,
                                                         make_backend: Any, how: str) -> None:
    b = make_backend(hosts=", ".join(f"{h}*1" for h in hosts["FIBER_SSH_HOSTS"].split()),
                     retry_lost=1.0, orphan_timeout=5.0)
    env = {"FIBER_RUN_ID": b.run_id}  # so that run_processes() finds the jobs
    jobs = [b.start_job(py("import time; print('up', flush=True); time.sleep(600)", env=env))
            for _ in range(3)]
    for job in jobs:
        deadline = time.monotonic() + T
        while "up" not in b.get_job_logs(job):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    on_h3 = next(j for j in jobs if j.host == "fiber-h3")
    if how == "cut":
        heal.append(("heal", "fiber-h3"))
        ctl(hosts, "cut", "fiber-h3")
    else:
        heal.append(("start-sshd", "fiber-h3"))
        kill_all_sshd("fiber-h3")
    assert b.wait_for_job(on_h3, T) == HOST_LOST_EXITCODE
    assert "lost root@" in b.get_job_logs(on_h3)
    assert b.end_reason(on_h3) is EndReason.HOST_LOST
    assert on_h3.state.detail.startswith(f"lost {on_h3.handle.host.name}: ")
    again = b.start_job(py("import socket; print(socket.gethostname())"))
    assert b.wait_for_job(again, T) == 0
    assert again.host != "fiber-h3"
    assert [b.poll_job(j) for j in jobs if j is not on_h3] == [None, None]
    # Cut off or left without sshd, the job's supervisor ends it; then the host comes back.
    assert wait_until_gone(b.run_id, ["fiber-h3"]) == []
    ctl(hosts, *heal.pop())
    deadline = time.monotonic() + T
    while True:
        job = b.start_job(py("pass"))
        assert b.wait_for_job(job, T) == 0
        if job.host == "fiber-h3":
            break
        assert time.monotonic() < deadline, "fiber-h3 was not used again"
        time.sleep(0.2)


def test_parent_killed_leaves_no_remote_process(hosts: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import os, subprocess, sys, time
        import fiber_core
        from fiber_core.runtime.run import runtime

        def target(q):
            subprocess.Popen(["/bin/sleep", "600"])  # something the job started
            q.put(os.getpid())
            time.sleep(600)

        if __name__ == "__main__":
            q = fiber_core.Queue()
            for _ in range(3):
                fiber_core.Process(target=target, args=(q,)).start()
            for _ in range(3):
                q.get(timeout=120)
            print(runtime().run_id, flush=True)
            time.sleep(600)
    """))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FIBER_") or k == "FIBER_SERVICES_DIR"}
    env.update(ssh_env(hosts, slots=1))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, cwd=tmp_path)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 2 * T)
        assert ready, "the script did not start its jobs"
        run_id = proc.stdout.readline().decode().strip()
        assert run_id, proc.stderr.read().decode()
        before = {ns: run_processes(ns, run_id) for ns in NAMES}
        assert all(len(found) >= 3 for found in before.values()), before  # supervisor, job, sleep
        proc.kill()
        proc.wait(T)
        assert wait_until_gone(run_id) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(T)


def test_non_daemon_process_finishes_its_work_before_the_program_exits(hosts: dict[str, str],
                                                                       tmp_path: Path) -> None:
    # paramiko's own exit handler closes every connection: Fiber's exit must have waited for
    # the child by then. The result goes where both sides see it (the hosts have their own /tmp).
    result = SERVICES / "ssh" / f"result-{os.getpid()}-{time.monotonic_ns()}"
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        import fiber_core

        def work(path):
            time.sleep(2)  # the work outlasts the main code, which does not join it
            with open(path, "w") as f:
                f.write("done")

        if __name__ == "__main__":
            fiber_core.Process(target=work, args=(sys.argv[1],)).start()
    """))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FIBER_") or k == "FIBER_SERVICES_DIR"}
    env.update(ssh_env(hosts, slots=1))
    try:
        out = subprocess.run([sys.executable, str(script), str(result)], capture_output=True, text=True,
                             env=env, cwd=tmp_path, timeout=2 * T)
        assert out.returncode == 0, out.stderr
        assert "lost host" not in out.stderr, out.stderr
        assert result.read_text() == "done", out.stderr
    finally:
        result.unlink(missing_ok=True)


def test_a_killed_supervisor_takes_its_job_with_it(make_backend: Any) -> None:
    """SIGTERM to a job's supervisor reaches the job; SIGKILL to it kills the job (no orphan)."""
    b = make_backend()
    env = {"FIBER_RUN_ID": b.run_id}
    for sig, code in ((signal.SIGTERM, -signal.SIGTERM), (signal.SIGKILL, None)):
        job = b.start_job(py("import time; print('up', flush=True); time.sleep(600)", env=env))
        deadline = time.monotonic() + T
        while "up" not in b.get_job_logs(job):
            assert time.monotonic() < deadline, b.get_job_logs(job)
            time.sleep(0.05)
        found = [line.split(maxsplit=1) for name in NAMES for line in run_processes(name, b.run_id)]
        supervisor = [int(pid) for pid, cmd in found if " -I -S -c " in cmd]  # see supervisor.py
        assert len(supervisor) == 1, found
        os.kill(supervisor[0], sig)
        if code is not None:
            assert b.wait_for_job(job, T) == code  # passed on; the supervisor reports the end
        assert wait_until_gone(b.run_id) == []  # the job is not left running


def test_start_jobs_fills_the_hosts_at_once_all_or_nothing(make_backend: Any) -> None:
    b = make_backend()
    jobs = b.start_jobs([py(f"import socket; print({i}, socket.gethostname())") for i in range(6)])
    for i, job in enumerate(jobs):  # in the order of the specs
        assert b.wait_for_job(job, T) == 0
        assert b.get_job_logs(job).split()[0] == str(i)
    assert sorted({j.host for j in jobs}) == NAMES
    # One spec that cannot start: the others of the call are killed, none is left running.
    env = {"FIBER_RUN_ID": b.run_id}  # so that run_processes() finds the jobs
    specs = [py("import time; time.sleep(600)", env=env) for _ in range(4)]
    specs.append(JobSpec(command=["python3", "-c", "pass"], volumes={"/data": "/data"}))
    with pytest.raises(BackendError, match="cannot mount volumes"):
        b.start_jobs(specs)
    assert wait_until_gone(b.run_id) == []


def _where(q: Any, code: int) -> None:
    import socket

    q.put((socket.gethostname(), os.getpid()))
    sys.exit(code)


def test_a_process_starts_on_a_spare_worker(hosts: dict[str, str], caplog: pytest.LogCaptureFixture) -> None:
    # SSH keeps one spare by default: after a start, the next runs in the worker started ahead;
    # a Pool that takes every slot takes the spare as a worker; when the program ends nothing is left.
    from fiber_core.processes import spares

    with fresh_runtime(ssh_env(hosts)) as rt:
        run_id = rt.run_id
        backend = rt.get_backend("ssh")
        q = fiber_core.Queue()
        first = fiber_core.Process(target=_where, args=(q, 0))
        first.start()
        assert q.get(timeout=T)[0] in NAMES
        first.join(T)
        assert spares.settle(T)
        (spare,) = spares.ready_jobs()
        assert spare.spec.name == "spare" and backend.poll_job(spare) is None
        p = fiber_core.Process(target=_where, args=(q, 6))
        p.start()
        host, _pid = q.get(timeout=T)
        p.join(T)
        assert p.job is spare and p.exitcode == 6 and spare.spec.name == p.name
        assert host == spare.host  # ran on the host of the spare
        assert spares.settle(T)
        (again,) = spares.ready_jobs()
        assert again is not spare
        with caplog.at_level(logging.WARNING, logger="fiber"), fiber_core.Pool(6) as pool:  # 3 hosts x 2 slots
            assert again in [w.process.job for w in pool._workers.values()]  # the spare is a worker
            assert pool.map(_square, range(12)) == [x * x for x in range(12)]
        assert "full" not in caplog.text  # 6 workers in the 6 slots, the spare's among them
        p = fiber_core.Process(target=_where, args=(q, 0))
        p.start()  # no spare: a cold start, which leaves one ready
        q.get(timeout=T)
        p.join(T)
        assert p.job is not again and spares.settle(T)
        (last,) = spares.ready_jobs()
    assert backend.wait_for_job(last, T) is not None  # the runtime's end let it go
    assert wait_until_gone(run_id) == []
