"""Per-process state of a Fiber program: run id, key, listener, backend, children.

The first process of a program (the one the user started) creates the run: a
random run id and a random 32-byte key. Jobs inherit both through their
environment, so every process of the run can authenticate to every other.
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from fiber_core.connection import server_handshake, tune
from fiber_core.errors import AuthenticationError
from fiber_core.util import log

if TYPE_CHECKING:
    from fiber_core.backend import Backend


ENV_RUN_ID = "FIBER_RUN_ID"
ENV_AUTHKEY = "FIBER_AUTHKEY"
ENV_HUB = "FIBER_PARENT_HUB"
ENV_TOKEN = "FIBER_PROCESS_TOKEN"

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


class Runtime:
    """Everything one process of a run knows: created on first use."""

    def __init__(self) -> None:
        self.run_id = os.environ.get(ENV_RUN_ID) or os.urandom(16).hex()[:12]
        key = os.environ.get(ENV_AUTHKEY)
        self.authkey = bytes.fromhex(key) if key else os.urandom(32)
        self.is_worker = ENV_TOKEN in os.environ
        # Proxies of the stdlib's managers authenticate with this process's authkey.
        import multiprocessing.process

        multiprocessing.process.current_process().authkey = self.authkey
        self._lock = threading.RLock()
        self._hub: Hub | None = None
        self._backends: dict[str, Backend] = {}
        self._rundir: str | None = None
        self.children: set = set()
        self.counter = 0
        atexit.register(self.shutdown)

    @property
    def rundir(self) -> str:
        with self._lock:
            if self._rundir is None:
                import tempfile

                self._rundir = tempfile.mkdtemp(prefix=f"fiber-{self.run_id}-")
                os.chmod(self._rundir, 0o700)
            return self._rundir

    @property
    def backend(self) -> Backend:
        """The configured backend (re-read each time, so a later ``init(backend=...)`` applies)."""
        return self.get_backend(None)

    def get_backend(self, name: str | None) -> Backend:
        """The backend for ``name`` (``None``: the configured one); one instance per backend."""
        from fiber_core.registry import create_backend, registry, selected_backend_name

        canonical = selected_backend_name() if name is None else registry.canonical(name)
        with self._lock:
            backend = self._backends.get(canonical)
            if backend is None:
                backend = self._backends[canonical] = create_backend(canonical, self.run_id)
            return backend

    @property
    def hub(self) -> Hub:
        with self._lock:
            if self._hub is None:
                from fiber_core.config import config

                host = config.get("listen_host") or self.backend.get_listen_addr()
                self._hub = Hub(self.authkey, host, config.get("listen_port"), self.rundir)
            return self._hub

    def addresses_for(self, backend: Backend) -> str:
        """This process's addresses as seen by jobs of ``backend``."""
        from fiber_core.config import config

        return self.hub.addresses_for(config.get("listen_host") or backend.get_listen_addr())

    def next_identity(self) -> int:
        with self._lock:
            self.counter += 1
            return self.counter

    def shutdown(self) -> None:
        """At exit: stop children as multiprocessing does, then release backend resources."""
        from fiber_core.process import _exit_children

        try:
            _exit_children()
        finally:
            for backend in list(self._backends.values()):
                try:
                    backend.cleanup()
                except Exception:
                    log.exception("fiber: cleanup of backend %s failed", backend.name)
            if self._hub is not None:
                self._hub.close()
            if self._rundir is not None:
                import shutil

                shutil.rmtree(self._rundir, ignore_errors=True)


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()
_sending = threading.local()


class sending_to:  # noqa: N801 - used as a context manager
    """While objects are pickled for a job, the addresses that job reaches this process at.

    Queues and Pipe ends owned by this process put these addresses in their pickle,
    so a job of any backend can dial back.
    """

    def __init__(self, addresses: str) -> None:
        self.addresses = addresses

    def __enter__(self) -> None:
        self.previous = getattr(_sending, "addresses", None)
        _sending.addresses = self.addresses

    def __exit__(self, *exc: object) -> None:
        _sending.addresses = self.previous


def outgoing_addresses(default: str) -> str:
    """The addresses to embed when pickling an object this process serves (see sending_to)."""
    return getattr(_sending, "addresses", None) or default


def runtime() -> Runtime:
    global _runtime
    if _runtime is None:
        with _runtime_lock:
            if _runtime is None:
                _runtime = Runtime()
    return _runtime
