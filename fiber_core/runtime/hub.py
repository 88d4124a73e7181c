"""The hub: this process's listener, and dialing another process's hub."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable

from fiber_core.base.errors import AuthenticationError
from fiber_core.base.log import log
from fiber_core.base.net import keepalive
from fiber_core.runtime.config import config
from fiber_core.wire.auth import client_handshake, server_handshake


def tune(sock: socket.socket) -> None:
    """Set up a TCP connection: no Nagle delay, and a peer that stops answering is dropped.

    A host that is lost sends no FIN, so without keepalives a connection to it (and
    whatever waits on it: a job's results, items lent by a queue) would wait for
    hours. With ``peer_timeout`` = T, an idle connection is probed after T/2 s, and
    it fails after 3 unanswered probes or after data goes unacknowledged for T s.
    """
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    timeout = config.get("peer_timeout")
    if timeout and timeout > 0:
        keepalive(sock, timeout / 2, timeout / 6, 3)


def dial(addresses: str, key: bytes, target: str, timeout: float = 30.0) -> socket.socket:
    """Connect to the hub at ``addresses`` (``unix:PATH,tcp:HOST:PORT``) and authenticate.

    The Unix address is tried first when its path exists here (same host), then TCP.
    """
    errors = []
    for addr in addresses.split(","):
        kind, _, rest = addr.partition(":")
        try:
            if kind == "unix":
                if not os.path.exists(rest):
                    continue
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout)
                sock.connect(rest)
            elif kind == "tcp":
                host, _, port = rest.rpartition(":")
                sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
            else:
                raise ValueError(f"unknown address kind {kind!r}")
            try:
                client_handshake(sock, key, target)
            except BaseException:
                sock.close()
                raise
            sock.settimeout(None)
            tune(sock)
            return sock
        except (OSError, EOFError) as e:
            errors.append(f"{addr}: {e}")
    raise ConnectionError(f"cannot reach the fiber process at {addresses}: " + "; ".join(errors))


Route = Callable[[str, socket.socket], None]


class Hub:
    """This process's listener: accepts, authenticates and routes incoming connections.

    One TCP port (on the backend's listen address) and one Unix socket per process.
    Each accepted connection is authenticated in its own short-lived thread, then
    handed to the route registered for the target it asked for; the route owns the
    socket from then on (and may keep the thread to serve it).
    """

    def __init__(self, key: bytes, host: str, port: int, rundir: str) -> None:
        self._key = key
        self._routes: dict[str, Route] = {}
        self._prefixes: dict[str, Route] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._port = port
        self._tcp: dict[str, str] = {}  # listen host -> "tcp:host:port"
        self._listeners: list[socket.socket] = []
        self._unix_path = os.path.join(rundir, "hub.sock")
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind(self._unix_path)
        unix.listen(512)
        self._listen(unix)
        self.addresses = self.addresses_for(host)

    def _listen(self, lsock: socket.socket) -> None:
        self._listeners.append(lsock)
        threading.Thread(target=self._accept_loop, args=(lsock,), daemon=True,
                         name="fiber-hub-accept").start()

    def addresses_for(self, host: str) -> str:
        """The addresses a job that reaches this process through ``host`` dials.

        Jobs of different backends may reach this process on different interfaces
        (loopback for local and Docker, a VPC address for Batch): the hub listens
        on each host it is asked for, all routing to the same targets.
        """
        with self._lock:
            if host not in self._tcp:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                tcp = socket.socket(family, socket.SOCK_STREAM)
                tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                tcp.bind((host, self._port if not self._tcp else 0))
                tcp.listen(512)
                shown = f"[{host}]" if ":" in host else host
                self._tcp[host] = f"tcp:{shown}:{tcp.getsockname()[1]}"
                self._listen(tcp)
            return f"unix:{self._unix_path},{self._tcp[host]}"

    def register(self, target: str, route: Route) -> None:
        with self._lock:
            self._routes[target] = route

    def register_prefix(self, prefix: str, route: Route) -> None:
        with self._lock:
            self._prefixes[prefix] = route

    def unregister(self, target: str) -> None:
        with self._lock:
            self._routes.pop(target, None)
            self._prefixes.pop(target, None)

    def _find(self, target: str) -> Route | None:
        with self._lock:
            route = self._routes.get(target)
            if route is None:
                for prefix, r in self._prefixes.items():
                    if target.startswith(prefix):
                        return r
            return route

    def _accept_loop(self, lsock: socket.socket) -> None:
        while not self._closed:
            try:
                sock, _ = lsock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), daemon=True,
                             name="fiber-hub-conn").start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(10.0)
            target = server_handshake(sock, self._key)
            route = self._find(target)
            if route is None:
                sock.sendall(b"NO")
                sock.close()
                return
            sock.sendall(b"OK")
            sock.settimeout(None)
            tune(sock)
        except (OSError, EOFError, AuthenticationError, UnicodeDecodeError) as e:
            log.debug("rejected a connection: %s", e)
            sock.close()
            return
        try:
            route(target, sock)
        except Exception:
            log.exception("fiber: error serving %s", target)
            sock.close()

    def close(self) -> None:
        self._closed = True
        for lsock in self._listeners:
            try:
                lsock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            lsock.close()


def reachable_host(parent_hub: str) -> str:
    """The address of this host on the route to the parent (what remote proxies dial)."""
    for addr in parent_hub.split(","):
        kind, _, rest = addr.partition(":")
        if kind != "tcp":
            continue
        host = rest.rpartition(":")[0].strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect((host, 9))  # no packet is sent for a UDP connect
                return s.getsockname()[0]
            except OSError:
                pass
    return "127.0.0.1"
