"""A platform API that goes away and comes back: a TCP forwarder for outage tests.

A restarted API server (kube-apiserver, dockerd behind TCP, a cloud endpoint) looks the same
to its clients whatever the reason: every open connection, watches included, is reset; new
connections are refused while it is down; then it answers again on the same address with the
state it had (etcd, the daemon's store, the cloud's records). :class:`Outage` produces exactly
that between a backend and a real server, on loopback::

    with Outage("127.0.0.1", 6443) as api:      # point the backend at api.port
        ...                                     # the run goes on
        api.cut()                               # resets everything, refuses new connections
        ...                                     # the platform is away
        api.restore()                           # the same port answers again

:meth:`Outage.unix` does the same for a Unix socket (a daemon such as dockerd). Used by the
platform-restart tests of the Kubernetes, AWS Batch and Docker backends; a third-party
backend can use it the same way against its own platform's API.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import struct
import threading
from types import TracebackType

_CHUNK = 65536


def _reset(sock: socket.socket) -> None:
    """Close with RST, as a peer whose process ended does (not a polite FIN)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class Outage:
    """Forwards ``127.0.0.1:port`` to ``host:target_port`` until :meth:`cut`; see the module."""

    def __init__(self, host: str, target_port: int, *, _unix: tuple[str, str] | None = None) -> None:
        self.target: tuple[str, int] | str = _unix[1] if _unix else (host, target_port)
        self.path = _unix[0] if _unix else None  # where a Unix-socket outage listens
        self._lock = threading.Lock()
        self._pairs: set[tuple[socket.socket, socket.socket]] = set()
        self._listener: socket.socket | None = self._listen(0)
        self.port: int = 0 if self.path else self._listener.getsockname()[1]
        self.cuts = 0  # how many times cut() reset connections
        self.accepted = 0  # connections forwarded, over the whole life
        self._closed = False
        self._accepting = threading.Thread(target=self._accept, args=(self._listener,), daemon=True,
                                           name="fiber-outage-accept")
        self._accepting.start()

    @classmethod
    def unix(cls, path: str, target: str) -> Outage:
        """Forward the Unix socket ``path`` to the one at ``target`` until :meth:`cut`."""
        return cls("", 0, _unix=(path, target))

    def _listen(self, port: int) -> socket.socket:
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)  # the socket file of the last listener
            s = socket.socket(socket.AF_UNIX)
            s.bind(self.path)
        else:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
        s.listen(64)
        return s

    def _connect(self) -> socket.socket:
        if isinstance(self.target, str):
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(self.target)
            except OSError:
                s.close()
                raise
            return s
        return socket.create_connection(self.target, timeout=10)

    @property
    def url(self) -> str:
        return f"unix://{self.path}" if self.path else f"http://127.0.0.1:{self.port}"

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut() or close() closed the listener
            try:
                server = self._connect()
            except OSError:
                _reset(client)
                continue
            with self._lock:
                if self._listener is not listener:  # cut while this one was being connected
                    _reset(client)
                    _reset(server)
                    return
                self._pairs.add((client, server))
                self.accepted += 1
            threading.Thread(target=self._pump, args=(client, server), daemon=True,
                             name="fiber-outage-pump").start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        other = {client: server, server: client}
        try:
            for s in other:
                s.settimeout(None)
                sel.register(s, selectors.EVENT_READ)
            while True:
                for key, _ in sel.select():
                    src = key.fileobj
                    assert isinstance(src, socket.socket)
                    data = src.recv(_CHUNK)
                    if not data:
                        return
                    other[src].sendall(data)
        except (OSError, ValueError):
            return  # reset by cut(), or the peer went
        finally:
            sel.close()
            with self._lock:
                self._pairs.discard((client, server))
            for s in (client, server):
                try:
                    s.close()
                except OSError:
                    pass

    def cut(self) -> None:
        """The platform goes away: open connections are reset, new ones refused."""
        with self._lock:
            listener, self._listener = self._listener, None
            pairs, self._pairs = self._pairs, set()
            self.cuts += 1
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
            except OSError:
                pass
            listener.close()
        for client, server in pairs:
            _reset(client)
            _reset(server)

    def restore(self) -> None:
        """The platform answers again, on the same port (or path)."""
        with self._lock:
            if self._listener is not None or self._closed:
                return
            listener = self._listen(self.port)
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True,
                         name="fiber-outage-accept").start()

    def close(self) -> None:
        self._closed = True
        self.cut()

    def __enter__(self) -> Outage:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
