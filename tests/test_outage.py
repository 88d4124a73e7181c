"""fiber_core.testing.outage: the forwarder that plays a platform API going away and back."""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Iterator

import pytest

from fiber_core.testing.outage import Outage


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(4096):
            self.request.sendall(data)


@pytest.fixture
def echo() -> Iterator[int]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _roundtrip(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
        return got


def test_the_outage_forwards_then_resets_and_refuses_then_answers_on_the_same_port(echo: int) -> None:
    with Outage("127.0.0.1", echo) as api:
        assert _roundtrip(api.port, b"hello" * 1000) == b"hello" * 1000
        held = socket.create_connection(("127.0.0.1", api.port), timeout=10)
        held.sendall(b"x")
        assert held.recv(1) == b"x"
        port = api.port
        api.cut()
        with pytest.raises(ConnectionError):  # an open connection (a watch) is reset
            held.sendall(b"y")
            if not held.recv(1):
                raise ConnectionResetError("closed")
        held.close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=10)
        api.restore()
        assert api.port == port and _roundtrip(port, b"back") == b"back"
        assert (api.cuts, api.accepted) == (1, 3)


def test_a_unix_socket_outage_refuses_then_answers_on_the_same_path(tmp_path) -> None:  # noqa: ANN001
    target = str(tmp_path / "daemon.sock")
    server = socketserver.ThreadingUnixStreamServer(target, _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    path = str(tmp_path / "front.sock")
    try:
        with Outage.unix(path, target) as api:
            assert api.url == f"unix://{path}"

            def roundtrip(payload: bytes) -> bytes:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(path)
                    s.sendall(payload)
                    return s.recv(len(payload))

            assert roundtrip(b"ping") == b"ping"
            api.cut()
            with pytest.raises((ConnectionRefusedError, FileNotFoundError)):
                roundtrip(b"x")
            api.restore()
            assert roundtrip(b"back") == b"back"
    finally:
        server.shutdown()
        server.server_close()
