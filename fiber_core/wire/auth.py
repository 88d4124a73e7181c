"""The handshake that opens every connection between the processes of a run.

The client sends ``FIBR``, the wire version and a nonce; each side proves with a MAC
(keyed BLAKE2b) over both nonces that it holds the run's key; the client names its
target (``pool:<id>``, ``queue:<id>``...) and the server answers ``OK`` or ``NO``.
Nothing is unpickled before this succeeds. The version byte changes whenever a
message of :mod:`fiber_core.wire.messages` does, so two versions of Fiber refuse
each other here instead of misreading each other's messages.
"""

from __future__ import annotations

import os
import socket
import struct
from _operator import (
    _compare_digest as compare_digest,  # hmac.compare_digest, without hmac's OpenSSL
)
from collections.abc import Callable

from fiber_core.base.blake2 import blake2b
from fiber_core.base.errors import AuthenticationError
from fiber_core.wire.framing import _recv_exact

_MAGIC = b"FIBR\x08"  # the wire version is the last byte


_NONCE = 16


_MAC = 32


_HANDSHAKE_TIMEOUT = 10.0


_KEY_MAX = 64
"""The longest key BLAKE2b takes: a longer run's key is hashed down to it first."""


def mac(key: bytes, *parts: bytes | memoryview) -> bytes:
    """A 32-byte MAC with ``key`` over ``parts`` in order, as if joined (none is copied).

    Keyed BLAKE2b, which is a MAC by design (no HMAC construction needed), as strong as
    HMAC-SHA256. The first part is a label of its use, so that no MAC made for one use
    passes for another.
    """
    if len(key) > _KEY_MAX:
        key = blake2b(key, person=b"fiber-key").digest()
    h = blake2b(key=key, digest_size=_MAC, person=b"fiber-mac")
    for part in parts:
        h.update(part)
    return h.digest()


def mac_matches(expected: bytes | memoryview, key: bytes, *parts: bytes | memoryview) -> bool:
    """Whether ``expected`` is :func:`mac` of ``parts`` with ``key`` (in constant time)."""
    return compare_digest(bytes(expected), mac(key, *parts))


def client_handshake(sock: socket.socket, key: bytes, target: str) -> None:
    """Authenticate to a :class:`Hub` as holder of ``key`` and ask for ``target``."""
    nonce = os.urandom(_NONCE)
    sock.sendall(_MAGIC + nonce)
    try:
        reply = _recv_exact(sock, _NONCE + _MAC)
    except EOFError:
        raise EOFError(
            f"the process at the other end closed the connection at the handshake: it is "
            f"ending, or it runs another version of Fiber (this one speaks wire version "
            f"{_MAGIC[-1]}; every process of a run must use the same one)") from None
    server_nonce, server_mac = reply[:_NONCE], reply[_NONCE:]
    if not compare_digest(server_mac, mac(key, b"fiber-s", nonce, server_nonce)):
        raise AuthenticationError("the peer does not hold this run's key")
    name = target.encode()
    sock.sendall(mac(key, b"fiber-c", server_nonce, nonce) + struct.pack("!H", len(name)) + name)
    if _recv_exact(sock, 2) != b"OK":
        raise ConnectionRefusedError(f"{target} is not served by that process (it may have ended)")


def server_handshake(sock: socket.socket, key: bytes, heard: Callable[[], None] | None = None) -> str:
    """Authenticate a client; return the target it asked for. Raises on any mismatch.

    ``heard`` is called once the client's hello (its first message) has come.
    """
    hello = _recv_exact(sock, len(_MAGIC) + _NONCE)
    if not hello.startswith(_MAGIC):
        if hello.startswith(_MAGIC[:-1]):
            raise AuthenticationError(f"a fiber client of wire version {hello[len(_MAGIC) - 1]}; "
                                      f"this process speaks version {_MAGIC[-1]}")
        raise AuthenticationError("not a fiber client")
    if heard is not None:
        heard()
    nonce = hello[len(_MAGIC):]
    server_nonce = os.urandom(_NONCE)
    sock.sendall(server_nonce + mac(key, b"fiber-s", nonce, server_nonce))
    answer = _recv_exact(sock, _MAC + 2)
    if not compare_digest(answer[:_MAC], mac(key, b"fiber-c", server_nonce, nonce)):
        raise AuthenticationError("client does not hold this run's key")
    (length,) = struct.unpack("!H", answer[_MAC:])
    return _recv_exact(sock, length).decode()
