"""TODO."""

from __future__ import annotations

import hmac
import os
import socket
import struct

from fiber_core.base.errors import AuthenticationError
from fiber_core.wire.framing import _recv_exact

_MAGIC = b"FIBR\x01"


_NONCE = 16


_MAC = 32


_HANDSHAKE_TIMEOUT = 10.0


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.digest(key, b"".join(parts), "sha256")


def client_handshake(sock: socket.socket, key: bytes, target: str) -> None:
    """Authenticate to a :class:`Hub` as holder of ``key`` and ask for ``target``."""
    nonce = os.urandom(_NONCE)
    sock.sendall(_MAGIC + nonce)
    reply = _recv_exact(sock, _NONCE + _MAC)
    server_nonce, server_mac = reply[:_NONCE], reply[_NONCE:]
    if not hmac.compare_digest(server_mac, _mac(key, b"fiber-s", nonce, server_nonce)):
        raise AuthenticationError("the peer does not hold this run's key")
    name = target.encode()
    sock.sendall(_mac(key, b"fiber-c", server_nonce, nonce) + struct.pack("!H", len(name)) + name)
    if _recv_exact(sock, 2) != b"OK":
        raise ConnectionRefusedError(f"{target} is not served by that process (it may have ended)")


def server_handshake(sock: socket.socket, key: bytes) -> str:
    """Authenticate a client; return the target it asked for. Raises on any mismatch."""
    hello = _recv_exact(sock, len(_MAGIC) + _NONCE)
    if not hello.startswith(_MAGIC):
        raise AuthenticationError("not a fiber client")
    nonce = hello[len(_MAGIC):]
    server_nonce = os.urandom(_NONCE)
    sock.sendall(server_nonce + _mac(key, b"fiber-s", nonce, server_nonce))
    answer = _recv_exact(sock, _MAC + 2)
    if not hmac.compare_digest(answer[:_MAC], _mac(key, b"fiber-c", server_nonce, nonce)):
        raise AuthenticationError("client does not hold this run's key")
    (length,) = struct.unpack("!H", answer[_MAC:])
    return _recv_exact(sock, length).decode()
