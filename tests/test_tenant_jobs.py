"""What a job leaves to the programs it starts: not the run's key, not its token.

A job reads the key and its token (or its group's secret) from its environment, then takes
them out of it: a program that a task starts (a simulator, a shell command) inherits neither,
and the block of ``/proc/<pid>/environ`` that every process of the same user can read no
longer holds them. Checked for every way a local job starts: a fresh interpreter, forked
from the template, a spare, a Pool's worker, and a job started by a job (which still can:
the key is in its runtime). A token without the key opens nothing.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess

import pytest

import fiber_core
from fiber_core.base.environ import block_bounds, entry_spans
from fiber_core.contract.env import ENV_AUTHKEY, ENV_GROUP, ENV_TOKEN, SECRET_VARIABLES
from fiber_core.processes import spares
from fiber_core.runtime.run import runtime
from fiber_core.wire.auth import _MAGIC
from fiber_core.wire.framing import _recv_exact

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed


def secrets_seen(key: str) -> dict[str, list[str]]:
    """Where this process shows a secret variable, or the key's value: in ``os.environ``,
    in the environment of a command it runs, in its ``/proc/self/environ``."""
    names = sorted(SECRET_VARIABLES)
    shown = {
        "os.environ": "\n".join(f"{k}={v}" for k, v in os.environ.items()),
        "env": subprocess.run(["env"], capture_output=True, text=True, timeout=T).stdout,
        "/proc/self/environ": open("/proc/self/environ", "rb").read().decode(errors="replace"),
    }
    wanted = [*(f"{n}=" for n in names), key]
    return {where: [w for w in wanted if w in text] for where, text in shown.items()}


def report(q: fiber_core.Queue, key: str) -> None:
    q.put((os.getpid(), secrets_seen(key)))


def report_from_a_job_of_its_own(q: fiber_core.Queue, key: str) -> None:
    child = fiber_core.Process(target=report, args=(q, key))
    child.start()
    child.join(T)
    q.put(("child exit", child.exitcode))


NOTHING = {"os.environ": [], "env": [], "/proc/self/environ": []}


def start_and_report(key: str) -> tuple[fiber_core.Process, int, dict[str, list[str]]]:
    q = fiber_core.Queue()
    p = fiber_core.Process(target=report, args=(q, key))
    p.start()
    pid, seen = q.get(timeout=T)
    p.join(T)
    assert p.exitcode == 0
    return p, pid, seen


@pytest.fixture
def key() -> str:
    return runtime().authkey.hex()


@pytest.mark.parametrize("start", ["fresh", "template"])
def test_a_local_job_and_what_it_starts_see_neither_key_nor_token(key: str, start: str) -> None:
    fiber_core.init(local_start=start)
    if start == "template":
        assert runtime().backend.wait_template(T)
    p, pid, seen = start_and_report(key)
    assert pid == p.pid
    assert seen == NOTHING


def test_a_spare_that_runs_a_process_sees_neither_key_nor_token(key: str) -> None:
    fiber_core.init(spare_jobs=1)
    try:
        start_and_report(key)
        assert spares.settle(T)
        (spare,) = spares.ready_jobs()
        p, _, seen = start_and_report(key)
        assert p.job is spare  # it ran on the spare
        assert seen == NOTHING
    finally:
        spares.release(T)


def pool_report(key: str) -> dict[str, list[str]]:
    return secrets_seen(key)


def test_a_pool_worker_sees_neither_key_nor_its_groups_secret(key: str) -> None:
    with fiber_core.Pool(2) as pool:
        assert pool.map(pool_report, [key] * 4) == [NOTHING] * 4


def test_a_job_still_starts_a_job_of_its_own(key: str) -> None:
    q = fiber_core.Queue()
    p = fiber_core.Process(target=report_from_a_job_of_its_own, args=(q, key))
    p.start()
    _, seen = q.get(timeout=T)
    assert q.get(timeout=T) == ("child exit", 0)
    p.join(T)
    assert p.exitcode == 0
    assert seen == NOTHING


def test_a_token_without_the_key_opens_nothing() -> None:
    """The hub reads the target (the token) only after the client proved the key: a client
    that names a live job's token but cannot prove the key is closed, never routed."""
    hub = runtime().hub
    token = os.urandom(16).hex()
    routed: list[socket.socket] = []
    hub.register(f"proc:{token}", lambda target, sock: routed.append(sock))
    try:
        tcp = next(a for a in hub.addresses.split(",") if a.startswith("tcp:"))  # anyone's way in
        host, _, port = tcp.removeprefix("tcp:").rpartition(":")
        with socket.create_connection((host.strip("[]"), int(port)), timeout=T) as sock:
            sock.sendall(_MAGIC + os.urandom(16))
            _recv_exact(sock, 16 + 32)  # the hub's nonce and proof
            name = f"proc:{token}".encode()
            sock.sendall(os.urandom(32) + struct.pack("!H", len(name)) + name)  # no proof of the key
            try:
                answer = sock.recv(2)
            except ConnectionResetError:  # closed before it read all that was sent
                answer = b""
            assert answer == b""  # closed: neither OK nor NO
        assert routed == []
    finally:
        hub.unregister(f"proc:{token}")


def test_only_whole_entries_of_the_names_are_found_in_an_environment_block() -> None:
    block = b"A=1\0FIBER_AUTHKEY=ab\0XFIBER_AUTHKEY=no\0FIBER_GROUP=g=h\0FIBER_GROUPS=x\0B=2"
    spans = entry_spans(block, [ENV_AUTHKEY, ENV_GROUP, ENV_TOKEN])
    assert [block[o:o + n] for o, n in spans] == [b"FIBER_AUTHKEY=ab", b"FIBER_GROUP=g=h"]
    assert entry_spans(b"", [ENV_AUTHKEY]) == []
    assert entry_spans(b"FIBER_AUTHKEY=", [ENV_AUTHKEY]) == [(0, 14)]


def test_the_environment_block_is_found_in_a_stat_line_whatever_the_command_name() -> None:
    fields = [str(n) for n in range(3, 53)]  # fields 3..52, each its own number
    line = "123 (a) (b c) " + " ".join(fields)
    assert block_bounds(line) == (50, 51)
    with open("/proc/self/stat") as f:
        start, end = block_bounds(f.read())
    assert 0 < start < end
