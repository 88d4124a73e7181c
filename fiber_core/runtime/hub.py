"""The hub: this process's listener, and dialing another process's hub."""

from __future__ import annotations

import errno
import os
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping

from fiber_core.base.errors import AuthenticationError
from fiber_core.base.log import log
from fiber_core.base.net import connect_tcp, keepalive
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


HANDSHAKE_RETRIES = 3
"""How many more times a dial tries a handshake that the listener ended (end of stream, reset).

A listener flooded with connections that do not authenticate sheds some of those waiting
(:class:`Handshakes`), and a job's may be among them: it dials again after a pause of 0.05 s,
then 0.2, then 0.8 (each with up to half of it added at random), within the dial's timeout.
"""


def _open(kind: str, rest: str, timeout: float) -> socket.socket | None:
    """A connected socket to one address of a hub; None for a Unix path that is not here."""
    if kind == "unix":
        if not os.path.exists(rest):
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(rest)
        except BaseException:
            sock.close()
            raise
        return sock
    if kind == "tcp":
        host, _, port = rest.rpartition(":")
        return connect_tcp(host.strip("[]"), int(port), timeout)
    raise ValueError(f"unknown address kind {kind!r}")


def _dial_one(addr: str, key: bytes, target: str, timeout: float) -> socket.socket | None:
    """Connect to one address and authenticate, trying a shed handshake again; None: not here."""
    kind, _, rest = addr.partition(":")
    deadline = time.monotonic() + timeout
    attempt = 0
    while (sock := _open(kind, rest, max(0.001, deadline - time.monotonic()))) is not None:
        try:
            client_handshake(sock, key, target)
        except (EOFError, ConnectionResetError, ConnectionAbortedError, BrokenPipeError):
            sock.close()
            pause = 0.05 * 4 ** attempt * (1.0 + os.urandom(1)[0] / 510)  # (no random: 1 ms to import)
            if attempt == HANDSHAKE_RETRIES or time.monotonic() + pause >= deadline:
                raise
            attempt += 1
            time.sleep(pause)  # a backoff: the listener is busy shedding strangers
            continue
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        tune(sock)
        return sock
    return None


def dial(addresses: str, key: bytes, target: str, timeout: float = 30.0) -> socket.socket:
    """Connect to the hub at ``addresses`` (``unix:PATH,tcp:HOST:PORT``) and authenticate.

    The Unix address is tried first when its path exists here (same host), then TCP. Each
    address has ``timeout`` seconds, in which a handshake that the hub ended is tried again
    (:data:`HANDSHAKE_RETRIES`).
    """
    errors = []
    for addr in addresses.split(","):
        try:
            sock = _dial_one(addr, key, target, timeout)
        except (OSError, EOFError) as e:
            errors.append(f"{addr}: {e}")
            continue
        if sock is not None:
            return sock
    raise ConnectionError(f"cannot reach the fiber process at {addresses}: " + "; ".join(errors))


Route = Callable[[str, socket.socket], None]


_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def pending_bound() -> int:
    """How many unauthenticated connections a listener holds: an eighth of the descriptor limit.

    Enough for every job of a large run dialing in at once, and few enough that a
    stranger's flood of idle connections leaves this process the descriptors it needs.
    """
    try:
        import resource  # POSIX only, like the Unix sockets of the hub

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            soft = -1
    except (ImportError, OSError, ValueError):
        soft = -1
    if soft < 0:
        soft = 4096
    return max(8, min(512, soft // 8))


def source_bound(bound: int) -> int:
    """How many of ``bound`` unauthenticated connections one source may hold: half (at least 8).

    So a stranger (every local user counts as one source: loopback) leaves the other half to
    jobs on other hosts, and a host with many jobs dialing at once still gets them in.
    """
    return max(8, bound // 2)


def source_of(peer: object) -> str:
    """Where a connection comes from, for the bound per source (``peer``: what ``accept`` gave).

    An IPv4 address; all of loopback as one (every local user may bind any of 127.0.0.0/8);
    an IPv6 address's /64 (what one host is usually given); ``local`` for a Unix socket.
    """
    if not isinstance(peer, tuple) or not peer:
        return "local"
    host = str(peer[0])
    if ":" not in host:  # IPv4, dotted as accept() gives it: no parsing (7 us) on each accept
        return "loopback" if host.startswith("127.") else host
    import ipaddress  # IPv6 peers only: a job that dials out never needs it (1 ms to import)

    try:
        ip = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return str(peer[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "loopback"
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class Waiting:
    """A connection that has not authenticated yet, as :func:`to_shed` sees it: ``source``,
    where it comes from (:func:`source_of`), and whether it ``spoke``: sent its first message
    (a hub's hello, the answer to a manager's challenge)."""

    __slots__ = ("source", "spoke")

    def __init__(self, source: str, spoke: bool = False) -> None:
        self.source = source
        self.spoke = spoke


def to_shed(waiting: Mapping[int, Waiting], bound: int, per_source: int) -> int | None:
    """Which waiting connection to shut down so that the bounds hold, or None if they do.

    ``waiting`` maps tokens to connections in the order they came. When the source with
    the most waiting holds more than ``per_source``, or all hold more than ``bound``, that
    source loses its oldest connection that has not spoken, or else its oldest: a stranger
    who opens connections and sends nothing cannot push out a job's handshake, and one
    source cannot take every place.
    """
    if not waiting:
        return None
    counts = Counter(w.source for w in waiting.values())
    source, most = counts.most_common(1)[0]  # (of equals, the one seen first: the oldest)
    if most <= per_source and len(waiting) <= bound:
        return None
    oldest = None
    for token, w in waiting.items():
        if w.source == source:
            if not w.spoke:
                return token
            if oldest is None:
                oldest = token
    return oldest


class _Pending(Waiting):
    __slots__ = ("deadline", "fd")

    def __init__(self, source: str, deadline: float, fd: int) -> None:
        super().__init__(source)
        self.deadline = deadline
        self.fd = fd


def shut_descriptor(fd: int) -> None:
    """Shut down both directions of the socket of descriptor ``fd``, without closing it.

    Closing would free a descriptor that the handshake's thread still reads from, and that
    another connection may get; shutting wakes that thread, which closes it.
    """
    sock = socket.socket(fileno=fd)
    try:
        sock.shutdown(socket.SHUT_RDWR)
    finally:
        sock.detach()


def _has_input(fd: int) -> bool:
    """Whether bytes (or the end of stream) wait to be read on ``fd``."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class Handshakes:
    """Connections that have not authenticated yet: bounded, each with one deadline.

    A listener passes each accepted connection to :meth:`admit` before its handshake, may
    say when it has spoken (:meth:`spoke`), and calls :meth:`done` after it. The whole
    handshake has ``timeout`` seconds (default ``handshake_timeout``), however slowly its
    bytes arrive; past that, or when the bounds are passed (:func:`to_shed`: ``bound`` in
    all, ``per_source`` from one source), a connection is shut down, which wakes its
    handshake with an end of stream. Authenticated connections are never shed here.
    """

    def __init__(self, bound: int | None = None, per_source: int | None = None,
                 timeout: float | None = None) -> None:
        self._bound = bound or pending_bound()
        self._per_source = per_source or source_bound(self._bound)
        self._timeout = timeout
        self._lock = threading.Condition(threading.Lock())
        self._pending: dict[int, _Pending] = {}  # in deadline order
        self._sources: Counter[str] = Counter()
        self._next = 0
        self._closed = False
        self._reaper = threading.Thread(target=self._reap, daemon=True, name="fiber-handshakes")
        try:
            self._reaper.start()
        except RuntimeError:  # made while the interpreter exits (3.12.0/1 forbid threads then)
            pass  # no deadlines at that point: the program is ending anyway

    def admit(self, fd: int, source: str = "local") -> int:
        """Start the clock of the connection on descriptor ``fd``. Returns its token."""
        timeout = self._timeout if self._timeout is not None else config.get("handshake_timeout")
        deadline = time.monotonic() + (timeout if timeout and timeout > 0 else 10.0)
        with self._lock:
            token = self._next
            self._next += 1
            self._pending[token] = _Pending(source, deadline, fd)
            self._sources[source] += 1
            if len(self._pending) > self._bound or self._sources[source] > self._per_source:
                self._enforce()
            self._lock.notify()
        return token

    def spoke(self, token: int) -> None:
        """The connection sent its first message: strangers that did not are shed before it."""
        with self._lock:
            pending = self._pending.get(token)
            if pending is not None:
                pending.spoke = True

    def done(self, token: int) -> bool:
        """The handshake ended: True if the connection is still ours (not shed meanwhile)."""
        with self._lock:
            pending = self._pending.pop(token, None)
            if pending is None:
                return False
            self._forget(pending)
            return True

    def shed_oldest(self) -> bool:
        """Shut the oldest waiting connection (a descriptor is needed). False if none waits."""
        with self._lock:
            if not self._pending:
                return False
            self._shed(next(iter(self._pending)))
            return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()

    def _enforce(self) -> None:
        """Shed until the bounds hold; one with bytes waiting counts as having spoken."""
        looked = 0
        while (token := to_shed(self._pending, self._bound, self._per_source)) is not None:
            pending = self._pending[token]
            if not pending.spoke and looked < 8 and _has_input(pending.fd):
                looked += 1  # (its handshake's thread has not read them yet)
                pending.spoke = True
                continue
            self._shed(token)

    def _forget(self, pending: _Pending) -> None:
        self._sources[pending.source] -= 1
        if not self._sources[pending.source]:
            del self._sources[pending.source]

    def _shed(self, token: int) -> None:
        pending = self._pending.pop(token)
        self._forget(pending)
        try:
            shut_descriptor(pending.fd)
        except OSError:
            pass

    def _reap(self) -> None:
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                while self._pending:
                    token = next(iter(self._pending))
                    if self._pending[token].deadline > now:
                        break
                    log.debug("closed a connection that did not authenticate in time")
                    self._shed(token)
                wait = (self._pending[next(iter(self._pending))].deadline - now
                        if self._pending else None)
                self._lock.wait(wait)


def accept_retrying(lsock: socket.socket, handshakes: Handshakes, closed: Callable[[], bool],
                    what: str) -> tuple[socket.socket, object] | None:
    """``lsock.accept()`` that survives its errors while the listener lives.

    Out of descriptors, the oldest unauthenticated connection is shed and the accept
    retried after a pause that doubles up to a second; a warning says so once per
    shortage, since every job that dials in waits meanwhile. None once the listener
    is closed. Otherwise the new socket and its peer's address, as ``accept()`` gives them.
    """
    delay = 0.0
    short = False
    while not closed():
        try:
            accepted = lsock.accept()
        except OSError as e:
            if closed() or e.errno in (errno.EBADF, errno.EINVAL, errno.ENOTSOCK):
                return None
            if e.errno in _OUT_OF_DESCRIPTORS:
                handshakes.shed_oldest()
                if not short:
                    log.warning("fiber: %s is out of file descriptors (%s); connections wait until "
                                "some are free: raise the limit (ulimit -n) or use fewer",
                                what, os.strerror(e.errno or 0))
                    short = True
            delay = min(1.0, max(0.01, delay * 2))
            time.sleep(delay)
            continue
        if short:
            log.warning("fiber: %s has file descriptors again", what)
        return accepted
    return None


class Hub:
    """This process's listener: accepts, authenticates and routes incoming connections.

    One TCP port (on the backend's listen address) and one Unix socket per process.
    Each accepted connection is authenticated in its own short-lived thread, then
    handed to the route registered for the target it asked for; the route owns the
    socket from then on (and may keep the thread to serve it). Connections that have
    not authenticated are bounded and have one deadline (:class:`Handshakes`), and
    errors of ``accept()`` are survived, so no client can stop the listener.
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
        self._handshakes = Handshakes()
        self._unix: str | None = os.path.join(rundir, "hub.sock")
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            unix.bind(self._unix)
        except OSError as e:  # a path too long for a Unix socket (a deep TMPDIR): TCP only
            unix.close()
            log.debug("fiber: no Unix socket for the hub at %s (%s): jobs on this host use TCP",
                      self._unix, e)
            self._unix = None
        else:
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
            return f"unix:{self._unix},{self._tcp[host]}" if self._unix else self._tcp[host]

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
        what = "the listener of this process"
        while (accepted := accept_retrying(lsock, self._handshakes, lambda: self._closed, what)) is not None:
            sock, peer = accepted
            token = self._handshakes.admit(sock.fileno(), source_of(peer))
            try:
                threading.Thread(target=self._serve, args=(sock, token), daemon=True,
                                 name="fiber-hub-conn").start()
            except Exception as e:  # no thread to be had: this connection goes, the listener stays
                log.warning("fiber: dropped a connection: %s", e)
                self._handshakes.done(token)
                sock.close()

    def _serve(self, sock: socket.socket, token: int) -> None:
        try:
            target = server_handshake(sock, self._key, heard=lambda: self._handshakes.spoke(token))
            route = self._find(target)
            if not self._handshakes.done(token):
                raise EOFError("the handshake took too long, or too many were waiting")
            if route is None:
                sock.sendall(b"NO")
                sock.close()
                return
            sock.sendall(b"OK")
            tune(sock)
        except (OSError, EOFError, AuthenticationError, UnicodeDecodeError) as e:
            self._handshakes.done(token)
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
        self._handshakes.close()
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
