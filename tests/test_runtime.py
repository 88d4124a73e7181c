"""The hub of a run: nothing a stranger sends to its ports is unpickled or run.

Rogue clients connect to the listening TCP port and to the Unix socket of this
process, the one the real children of the test talk to.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
from pathlib import Path

import pytest

import fiber_core
from fiber_core.backends.local import LocalBackend
from fiber_core.base.errors import AuthenticationError
from fiber_core.base.net import connect_tcp
from fiber_core.runtime.hub import dial
from fiber_core.runtime.run import runtime
from fiber_core.wire.auth import _MAGIC

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed


class _Touch:
    """Unpickling this creates ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


class _System:
    """Unpickling this runs a shell command creating ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.path}",))


def _address(kind: str) -> str:
    return dict(a.split(":", 1) for a in runtime().hub.addresses.split(","))[kind]


def connect(kind: str) -> socket.socket:
    addr = _address(kind)
    if kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(addr)
    else:
        host, _, port = addr.rpartition(":")
        sock = socket.create_connection((host.strip("[]"), int(port)))
    sock.settimeout(T)
    return sock


def assert_disconnected(sock: socket.socket) -> None:
    """The hub closes the connection (a timeout here fails the test)."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    finally:
        sock.close()


def _echo(inbox: fiber_core.Queue, outbox: fiber_core.Queue) -> None:
    outbox.put(("echo", inbox.get()))


def assert_run_still_works(q: fiber_core.Queue) -> None:
    """A queue made before the attack, and a new child, still work."""
    out = fiber_core.Queue()
    p = fiber_core.Process(target=_echo, args=(q, out))
    p.start()
    q.put("after the attack")
    assert out.get(timeout=T) == ("echo", "after the attack")
    p.join(T)
    assert p.exitcode == 0


@pytest.fixture
def bait(tmp_path: Path) -> tuple[bytes, list[Path]]:
    """A pickle that creates two files if anyone unpickles it, and those files."""
    paths = [tmp_path / "opened", tmp_path / "touched"]
    return pickle.dumps([_Touch(paths[0]), _System(paths[1])]), paths


KINDS = ["tcp", "unix"]


@pytest.mark.parametrize("kind", KINDS)
def test_raw_pickle_is_not_unpickled(kind: str, bait: tuple[bytes, list[Path]]) -> None:
    payload, paths = bait
    q = fiber_core.Queue()
    for data in (payload, struct.pack("!I", len(payload)) + payload):
        sock = connect(kind)
        sock.sendall(data)
        assert_disconnected(sock)
    assert_run_still_works(q)
    assert not any(p.exists() for p in paths)


@pytest.mark.parametrize("kind", KINDS)
def test_right_magic_wrong_mac(kind: str, bait: tuple[bytes, list[Path]]) -> None:
    payload, paths = bait
    q = fiber_core.Queue()
    target = f"queue:{q._id}".encode()
    frame = struct.pack("!I", len(payload)) + payload
    for answer in (os.urandom(32) + struct.pack("!H", len(target)) + target + frame,
                   frame + os.urandom(64)):
        sock = connect(kind)
        sock.sendall(_MAGIC + os.urandom(16))
        challenge = b""
        while len(challenge) < 48:  # the server's nonce and MAC
            chunk = sock.recv(48 - len(challenge))
            assert chunk
            challenge += chunk
        sock.sendall(answer)
        assert_disconnected(sock)
    assert_run_still_works(q)
    assert not any(p.exists() for p in paths)


@pytest.mark.parametrize("kind", KINDS)
def test_dial_with_another_key(kind: str, bait: tuple[bytes, list[Path]]) -> None:
    payload, paths = bait
    q = fiber_core.Queue()
    with pytest.raises(AuthenticationError):
        dial(f"{kind}:{_address(kind)}", os.urandom(32), f"queue:{q._id}", timeout=T)
    assert_run_still_works(q)
    assert not any(p.exists() for p in paths)


@pytest.mark.parametrize("kind", KINDS)
def test_silent_clients_do_not_block_the_run(kind: str) -> None:
    q = fiber_core.Queue()
    idle = [connect(kind) for _ in range(20)]
    half_open = connect(kind)
    half_open.sendall(_MAGIC[:3])
    try:
        assert_run_still_works(q)
    finally:
        for sock in [*idle, half_open]:
            sock.close()


@pytest.mark.parametrize("family, host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_a_numeric_address_is_connected_to_without_the_resolver(
        family: int, host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        server = socket.socket(family, socket.SOCK_STREAM)
        server.bind((host, 0))
    except OSError:
        pytest.skip(f"no {host} here")
    server.listen()
    port = server.getsockname()[1]

    def no_resolver(*args: object, **kwargs: object) -> None:
        raise AssertionError("the resolver was asked")

    with server:
        monkeypatch.setattr(socket, "getaddrinfo", no_resolver)
        with connect_tcp(host, port, T) as sock:
            peer, _ = server.accept()
            peer.sendall(b"x")
            assert sock.recv(1) == b"x" and sock.gettimeout() == T
            peer.close()
        with pytest.raises(AssertionError, match="resolver"):
            connect_tcp("localhost", port, T)  # a name is resolved, as create_connection does
        monkeypatch.undo()
    with pytest.raises(ConnectionRefusedError):
        connect_tcp(host, port, T)  # nothing listens there any more


def test_right_key_unknown_target_is_a_clear_error() -> None:
    with pytest.raises(ConnectionError, match="not served"):
        dial(runtime().hub.addresses, runtime().authkey, "queue:no-such-queue", timeout=T)


def test_unix_socket_is_private() -> None:
    path = Path(_address("unix"))
    assert path.parent.stat().st_mode & 0o777 == 0o700


def test_the_bait_is_live(bait: tuple[bytes, list[Path]]) -> None:
    """Unpickled, the payload of these tests does create the files they check for."""
    payload, paths = bait
    for f in pickle.loads(payload):
        if hasattr(f, "close"):
            f.close()
    assert all(p.exists() for p in paths)


class _SecondLoopbackBackend(LocalBackend):
    """Local jobs that reach their parent on 127.0.0.2, and over TCP only."""

    name = "second-loopback"
    specs: list = []

    def get_listen_addr(self) -> str:
        return "127.0.0.2"

    def create_job(self, spec):  # noqa: ANN001, ANN201
        hub = spec.env["FIBER_PARENT_HUB"]
        spec.env["FIBER_PARENT_HUB"] = ",".join(a for a in hub.split(",") if a.startswith("tcp:"))
        self.specs.append(spec)
        return super().create_job(spec)


class _SecondLoopbackPlugin:
    @fiber_core.hookimpl
    def fiber_register_backends(self, register) -> None:  # noqa: ANN001
        register(_SecondLoopbackBackend)


def _echo_through(q_in, q_out) -> None:  # noqa: ANN001
    q_out.put(q_in.get(timeout=30) + 1)


def test_each_backend_gets_its_own_listen_address() -> None:
    from fiber_core.runtime.config import plugins

    if not plugins().pm.has_plugin("second-loopback"):
        plugins().register_plugin(_SecondLoopbackPlugin(), name="second-loopback")
    q_in, q_out = fiber_core.Queue(), fiber_core.Queue()
    q_in.put(41)
    p = fiber_core.Process(target=_echo_through, args=(q_in, q_out), backend="second-loopback")
    p.start()
    # The job was told 127.0.0.2, and the queues it carries dial back there, over TCP.
    assert q_out.get(timeout=30) == 42
    p.join(30)
    assert p.exitcode == 0
    assert "tcp:127.0.0.2:" in _SecondLoopbackBackend.specs[-1].env["FIBER_PARENT_HUB"]
