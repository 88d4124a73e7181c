"""The listeners of a run (the hub, a manager server) under hostile or unlucky conditions.

A flood of idle connections, a process out of file descriptors, handshakes that
trickle in or never come: the listener goes on accepting, holds a bounded number
of strangers, closes each handshake at its deadline, and jobs keep working.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import fiber_core
from fiber_core.backends.local import LocalBackend
from fiber_core.runtime.config import plugins
from fiber_core.runtime.hub import (
    HANDSHAKE_RETRIES,
    Waiting,
    dial,
    pending_bound,
    source_bound,
    source_of,
    to_shed,
)
from fiber_core.runtime.run import runtime
from fiber_core.wire.auth import _MAGIC, server_handshake

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed


class TcpOnlyBackend(LocalBackend):
    """Local jobs that reach their parent over TCP only, as remote ones do."""

    name = "tcp-only"
    shares_this_machine = False

    def get_listen_addr(self) -> str:
        return "127.0.0.1"

    def create_job(self, spec):  # noqa: ANN001, ANN201
        hub = spec.env["FIBER_PARENT_HUB"]
        spec.env["FIBER_PARENT_HUB"] = ",".join(a for a in hub.split(",") if a.startswith("tcp:"))
        return super().create_job(spec)


class _TcpOnlyPlugin:
    @fiber_core.hookimpl
    def fiber_register_backends(self, register) -> None:  # noqa: ANN001
        register(TcpOnlyBackend)


@pytest.fixture
def tcp_only() -> str:
    if not plugins().pm.has_plugin("tcp-only"):
        plugins().register_plugin(_TcpOnlyPlugin(), name="tcp-only")
    return "tcp-only"


def _echo(inbox: fiber_core.Queue, outbox: fiber_core.Queue) -> None:
    outbox.put(("echo", inbox.get(timeout=T)))


def _square(x: int) -> int:
    return x * x


def assert_jobs_work_over_tcp(backend: str) -> None:
    """A new job reaches this process over TCP, and so do the queues it was given."""
    inbox, outbox = fiber_core.Queue(), fiber_core.Queue()
    p = fiber_core.Process(target=_echo, args=(inbox, outbox), backend=backend)
    p.start()
    inbox.put("still here")
    assert outbox.get(timeout=T) == ("echo", "still here")
    p.join(T)
    assert p.exitcode == 0
    with fiber_core.Pool(2, backend=backend) as pool:
        assert pool.map(_square, range(50)) == [x * x for x in range(50)]


def _hub_address(kind: str) -> str:
    return dict(a.split(":", 1) for a in runtime().hub.addresses.split(","))[kind]


def _connect(kind: str, address: str | None = None) -> socket.socket:
    addr = address or _hub_address(kind)
    if kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(addr)
    else:
        host, _, port = addr.rpartition(":")
        sock = socket.create_connection((host.strip("[]"), int(port)))
    sock.settimeout(T)
    return sock


def assert_closed_by_peer(sock: socket.socket) -> None:
    """The listener closes the connection (reaching ``T`` fails the test)."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    finally:
        sock.close()


def bytes_sent_before_closed(sock: socket.socket, data: bytes, interval: float) -> int:
    """Send ``data`` a byte every ``interval`` seconds until the peer closes; how many went."""
    for i in range(len(data)):
        try:
            sock.sendall(data[i:i + 1])
        except OSError:
            return i
        readable, _, _ = select.select([sock], [], [], interval)
        if readable:
            try:
                if not sock.recv(65536):
                    return i + 1
            except ConnectionResetError:
                return i + 1
    return len(data)


# -- a flood of idle connections ----------------------------------------------------------

_FLOODER = """
import resource, selectors, socket, sys
host, port, n, bound = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
socks = [socket.create_connection((host, port)) for _ in range(n)]
sel = selectors.DefaultSelector()
for s in socks:
    sel.register(s, selectors.EVENT_READ)
closed = 0
while closed < n - bound:
    events = sel.select(30)
    if not events:
        break
    for key, _ in events:
        try:
            data = key.fileobj.recv(100)
        except ConnectionResetError:
            data = b""
        if not data:
            sel.unregister(key.fileobj)
            closed += 1
print(closed, flush=True)
sys.stdin.read()
"""


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(120)
def test_a_flood_of_idle_connections_is_bounded_and_jobs_still_dial_in(tcp_only: str) -> None:
    # The handshake deadline is beyond the test: what is shed goes for the bound alone.
    fiber_core.init(handshake_timeout=3 * T)
    host, _, port = _hub_address("tcp").rpartition(":")
    bound, n = source_bound(pending_bound()), pending_bound() + 600  # one source: loopback
    before = _open_descriptors()
    flooder = subprocess.Popen([sys.executable, "-c", _FLOODER, host, port, str(n), str(bound)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert flooder.stdout is not None
        closed = int(flooder.stdout.readline())
        # The oldest strangers were shed; the newest still wait, as many as one source may.
        assert closed == n - bound
        held = sum(t.name == "fiber-hub-conn" for t in threading.enumerate())
        assert held <= bound + 16  # (a few may serve connections of the run itself)
        assert _open_descriptors() <= before + bound + 16
        assert_jobs_work_over_tcp(tcp_only)
    finally:
        flooder.kill()
        flooder.communicate()


# -- out of descriptors -------------------------------------------------------------------

_OUT_OF_DESCRIPTORS = """
import logging, os, resource, threading
import fiber_core
from fiber_core.backends.local import LocalBackend
from fiber_core.runtime.config import plugins

class TcpOnlyBackend(LocalBackend):
    name = "tcp-only"
    shares_this_machine = False

    def get_listen_addr(self):
        return "127.0.0.1"

    def create_job(self, spec):
        hub = spec.env["FIBER_PARENT_HUB"]
        spec.env["FIBER_PARENT_HUB"] = ",".join(a for a in hub.split(",") if a.startswith("tcp:"))
        return super().create_job(spec)

class Plugin:
    @fiber_core.hookimpl
    def fiber_register_backends(self, register):
        register(TcpOnlyBackend)

class Seen(logging.Handler):
    def __init__(self):
        super().__init__()
        self.event = threading.Event()

    def emit(self, record):
        if "out of file descriptors" in record.getMessage():
            self.event.set()

def put(q, x):
    q.put(x)

def square(x):
    return x * x

if __name__ == "__main__":
    plugins().register_plugin(Plugin(), name="tcp-only")
    seen = Seen()
    logging.getLogger("fiber").addHandler(seen)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    q = fiber_core.Queue()
    with fiber_core.Pool(1, backend="tcp-only") as pool:
        assert pool.apply(square, (3,)) == 9  # what a map needs is loaded before the shortage
        filler = []
        try:
            while True:
                filler.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        # Every descriptor is taken: the worker dials in to reach q, and must wait.
        result = pool.apply_async(put, (q, 42))
        assert seen.event.wait(30), "no warning about descriptors"
        for fd in filler:
            os.close(fd)
        result.get(30)
        assert q.get(timeout=30) == 42
    with fiber_core.Pool(2, backend="tcp-only") as pool:  # new jobs dial in too
        assert pool.map(square, range(50)) == [x * x for x in range(50)]
    print("ok")
"""


@pytest.mark.timeout(120)
def test_out_of_descriptors_the_hub_waits_and_goes_on_accepting(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(_OUT_OF_DESCRIPTORS)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                       timeout=3 * T)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "ok"  # the script also saw the warning telling the user


_FLOODED = """
import resource, sys
import fiber_core
from fiber_core.backends.local import LocalBackend
from fiber_core.runtime.config import plugins
from fiber_core.runtime.hub import pending_bound, source_bound
from fiber_core.runtime.run import runtime

class TcpOnlyBackend(LocalBackend):
    name = "tcp-only"
    shares_this_machine = False

    def get_listen_addr(self):
        return "127.0.0.1"

    def create_job(self, spec):
        hub = spec.env["FIBER_PARENT_HUB"]
        spec.env["FIBER_PARENT_HUB"] = ",".join(a for a in hub.split(",") if a.startswith("tcp:"))
        return super().create_job(spec)

class Plugin:
    @fiber_core.hookimpl
    def fiber_register_backends(self, register):
        register(TcpOnlyBackend)

def square(x):
    return x * x

if __name__ == "__main__":
    plugins().register_plugin(Plugin(), name="tcp-only")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    tcp = [a for a in runtime().addresses_for(runtime().get_backend("tcp-only")).split(",")
           if a.startswith("tcp:")][0]
    print(tcp[4:], source_bound(pending_bound()), flush=True)
    sys.stdin.readline()  # flooded: more idle connections than this process has descriptors
    with fiber_core.Pool(2, backend="tcp-only") as pool:
        assert pool.map(square, range(50)) == [x * x for x in range(50)]
    print("ok", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_flood_beyond_the_descriptor_limit_leaves_jobs_dialing_in_over_tcp(tmp_path: Path,
                                                                            own_tmpdir: str) -> None:
    script = tmp_path / "script.py"
    script.write_text(_FLOODED)
    parent = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                              env={**os.environ, "TMPDIR": own_tmpdir})  # killed at the end
    flooder = None
    try:
        assert parent.stdin is not None and parent.stdout is not None
        address, bound = parent.stdout.readline().split()
        host, _, port = address.rpartition(":")
        n = 1100  # the usual limit is 1024; this process has 256
        flooder = subprocess.Popen([sys.executable, "-c", _FLOODER, host, port, str(n), bound],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert flooder.stdout is not None
        assert int(flooder.stdout.readline()) == n - int(bound)  # all but the newest were shed
        parent.stdin.write("flooded\n")
        parent.stdin.flush()
        assert parent.stdout.readline().strip() == "ok"
    finally:
        for p in (parent, flooder):
            if p is not None:
                p.kill()
                p.communicate()


# -- handshakes that trickle in or never come ------------------------------------------------

DEADLINE = 1.0  # handshake_timeout in these tests
TRICKLE = 0.5  # seconds between two bytes of a slow handshake


@pytest.mark.parametrize("kind", ["tcp", "unix"])
def test_hub_closes_a_slow_handshake_at_its_deadline(kind: str) -> None:
    fiber_core.init(handshake_timeout=DEADLINE)
    hello = _MAGIC + os.urandom(16)
    with _connect(kind) as sock:
        # Each byte comes before any per-read timeout: only the one deadline ends it.
        sent = bytes_sent_before_closed(sock, hello[:-1], TRICKLE)
    assert sent < len(hello) - 1


@pytest.mark.parametrize("kind", ["tcp", "unix"])
def test_hub_closes_a_silent_handshake_at_its_deadline(kind: str) -> None:
    fiber_core.init(handshake_timeout=DEADLINE)
    assert_closed_by_peer(_connect(kind))
    assert_jobs_work_over_tcp("local")


@pytest.fixture
def manager_address() -> object:
    fiber_core.init(handshake_timeout=DEADLINE)  # the server job gets this process's settings
    manager = fiber_core.Manager()
    try:
        yield manager.address
        assert manager.list([1, 2])[:] == [1, 2]  # what the test did left the server working
    finally:
        manager.shutdown()


def _connect_manager(address: object) -> socket.socket:
    if isinstance(address, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(address)
    else:
        sock = socket.create_connection(address)  # type: ignore[arg-type]
    sock.settimeout(T)
    return sock


def _read_challenge(sock: socket.socket) -> None:
    (n,) = struct.unpack("!i", sock.recv(4, socket.MSG_WAITALL))
    assert len(sock.recv(n, socket.MSG_WAITALL)) == n


def test_manager_closes_a_silent_handshake_at_its_deadline(manager_address: object) -> None:
    sock = _connect_manager(manager_address)
    _read_challenge(sock)
    assert_closed_by_peer(sock)


def test_manager_closes_a_handshake_that_sent_only_a_length(manager_address: object) -> None:
    sock = _connect_manager(manager_address)
    _read_challenge(sock)
    sock.sendall(struct.pack("!i", 100))
    assert_closed_by_peer(sock)


def test_manager_closes_a_slow_handshake_at_its_deadline(manager_address: object) -> None:
    sock = _connect_manager(manager_address)
    _read_challenge(sock)
    answer = struct.pack("!i", 32) + os.urandom(32)
    with sock:
        sent = bytes_sent_before_closed(sock, answer[:-1], TRICKLE)
    assert sent < len(answer) - 1


def test_manager_of_remote_jobs_binds_only_the_address_they_reach(tcp_only: str) -> None:
    manager = fiber_core.Manager(backend=tcp_only)
    try:
        host, port = manager.address
        assert host == "127.0.0.1"  # where this host meets its parent
        assert manager.list([3])[:] == [3]
        with pytest.raises(ConnectionRefusedError):  # another address of this host
            socket.create_connection(("127.0.0.2", port), timeout=T).close()
    finally:
        manager.shutdown()


# -- what is shed first, and a dial that tries again ------------------------------------------


def _waiting(*entries: str) -> dict[int, Waiting]:
    """Connections in the order they came: ``"a"`` from source a, silent; ``"a!"``: it spoke."""
    return {i: Waiting(e.rstrip("!"), e.endswith("!")) for i, e in enumerate(entries)}


def test_nothing_is_shed_while_both_bounds_hold() -> None:
    assert to_shed({}, 4, 2) is None
    assert to_shed(_waiting("a", "a", "b", "c"), 4, 2) is None


def test_past_the_bound_the_oldest_silent_connection_goes_before_any_that_spoke() -> None:
    assert to_shed(_waiting("a!", "b!", "a", "b", "a"), 4, 4) == 2
    assert to_shed(_waiting("a!", "a!", "a!", "a!", "a"), 4, 8) == 4  # even the newest


def test_when_every_connection_spoke_the_oldest_of_the_largest_source_goes() -> None:
    assert to_shed(_waiting("a!", "b!", "b!", "a!", "b!"), 4, 4) == 1


def test_one_source_past_its_share_loses_its_own_even_below_the_bound() -> None:
    # c's connection is older and silent, but the source past its share is a.
    assert to_shed(_waiting("c", "a!", "a", "a"), 8, 2) == 2
    assert to_shed(_waiting("c", "a!", "a!", "a!"), 8, 2) == 1


@pytest.mark.parametrize(("peer", "source"), [
    (("10.1.2.3", 5000), "10.1.2.3"),
    (("127.0.0.1", 5000), "loopback"),
    (("127.9.8.7", 5000), "loopback"),  # any local user may bind any loopback address
    (("::1", 5000, 0, 0), "loopback"),
    (("::ffff:10.1.2.3", 5000, 0, 0), "10.1.2.3"),
    (("2001:db8:1:2:3:4:5:6", 5000, 0, 0), "2001:db8:1:2::/64"),
    (("fe80::1%eth0", 5000, 0, 2), "fe80::/64"),
    ("", "local"),  # a Unix socket's peer
])
def test_the_source_of_a_connection(peer: object, source: str) -> None:
    assert source_of(peer) == source


def _flaky_listener(key: bytes, ended: int, answers: bool = True) -> tuple[socket.socket, threading.Thread]:
    """A listener that ends the handshake of its first ``ended`` connections, then answers (if
    ``answers``) the next one."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with lsock:
            for i in range(ended + answers):
                conn, _ = lsock.accept()
                with conn:
                    if i < ended:
                        conn.recv(len(_MAGIC) + 16, socket.MSG_WAITALL)  # its hello, then shed
                        continue
                    assert server_handshake(conn, key) == "t"
                    conn.sendall(b"OK")
                    conn.recv(1)  # until the client closes

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return lsock, thread


def test_a_dial_whose_handshake_was_shed_tries_again() -> None:
    key = os.urandom(32)
    lsock, thread = _flaky_listener(key, HANDSHAKE_RETRIES)
    sock = dial(f"tcp:127.0.0.1:{lsock.getsockname()[1]}", key, "t", timeout=T)
    sock.close()
    thread.join(T)
    assert not thread.is_alive()


def test_a_dial_gives_up_after_its_retries_with_the_reason() -> None:
    key = os.urandom(32)
    lsock, thread = _flaky_listener(key, HANDSHAKE_RETRIES + 1, answers=False)
    with pytest.raises(ConnectionError, match="closed the connection at the handshake"):
        dial(f"tcp:127.0.0.1:{lsock.getsockname()[1]}", key, "t", timeout=T)
    thread.join(T)
    assert not thread.is_alive()  # every try reached it
