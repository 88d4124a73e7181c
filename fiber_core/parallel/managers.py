"""Managers: shared objects served by a job, reached through proxies from anywhere.

``BaseManager``, ``SyncManager`` and ``Manager()`` are the standard library's
manager protocol and proxies (which authenticate every connection with an HMAC
challenge before anything is unpickled), with three differences:

* the server runs as a Fiber job on the selected backend, started through
  :class:`fiber_core.Process`; it listens on a Unix socket when its clients share
  its machine, else on the one address its host uses to reach the parent;
* the address it reports is the one its host uses to reach the parent, so
  proxies work from any process of the program, on any machine;
* every process of the run uses the run's key, so proxies can be passed to
  children (and grandchildren) as arguments;
* as the run's hub does, the server bounds the connections that have not
  authenticated, gives each handshake one deadline (``handshake_timeout``), and
  survives errors of ``accept()``, running out of descriptors included.

:class:`AsyncManager` adds non-blocking proxies: each method call returns an
:class:`AsyncHandle` at once. Calls on one proxy are pipelined over its own
connection and served in order; calls on different proxies run concurrently in
the server. This is what drives N remote simulators from one policy::

    envs = [manager.Env() for _ in range(n)]
    handles = [env.step(a) for env, a in zip(envs, actions)]
    observations = [h.get() for h in handles]
"""

from __future__ import annotations

import collections
import multiprocessing.connection as _std_connection
import multiprocessing.managers as _std
import multiprocessing.process as _std_process
import multiprocessing.resource_tracker as _resource_tracker
import multiprocessing.shared_memory as _shared_memory
import multiprocessing.util as _std_util
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from typing import Any, ClassVar, Protocol, cast

from fiber_core.base.errors import FiberError, ProcessError, TimeoutError
from fiber_core.contract.env import ENV_HUB
from fiber_core.parallel.pool import Pool
from fiber_core.processes.pipe import Pipe
from fiber_core.processes.process import Process
from fiber_core.runtime.hub import Handshakes, accept_retrying, reachable_host, source_of
from fiber_core.runtime.run import runtime


class _StateRecord(Protocol):
    """A manager's ``_state``: ``value`` is one of the class's three constants."""

    INITIAL: ClassVar[int]
    STARTED: ClassVar[int]
    SHUTDOWN: ClassVar[int]
    value: int


_RegistryEntry = tuple[Callable[..., Any], Iterable[str], dict[str, str], Any]
"""A registered type as the stdlib keeps it: (callable, exposed, method_to_typeid, proxytype)."""


class _StdInternals(Protocol):
    """The undocumented parts of :mod:`multiprocessing.managers` this module builds on.

    typeshed leaves them out of its stubs; this describes the ones used here.
    """

    State: type[_StateRecord]
    PoolProxy: type[_std.BaseProxy]
    listener_client: dict[str, tuple[Callable[..., Any], Callable[..., Connection[Any, Any]]]]

    def dispatch(self, c: Connection[Any, Any], id: str | None, methodname: str,
                 args: tuple[Any, ...] = (), kwds: dict[str, Any] = ...) -> Any: ...

    def convert_to_error(self, kind: str, result: Any) -> Exception: ...


_internals = cast(_StdInternals, _std)

State = _internals.State


Token = _std.Token


BaseProxy = _std.BaseProxy


RemoteError = _std.RemoteError


Namespace = _std.Namespace


def share_run_key() -> bytes:
    """Give this process the run's key as its stdlib authkey (proxies use it)."""
    key = runtime().authkey
    _std_process.current_process().authkey = key
    return key


def _serve(cls: type[BaseManager], registry: dict[str, _RegistryEntry], authkey: bytes,
           serializer: str, writer: Any, initializer: Callable[..., object] | None,
           initargs: Iterable[Any], same_host: bool) -> None:
    """The manager job: create the server, report its address, serve.

    On the local backend every client shares this host: a Unix socket, as the
    standard library uses. Elsewhere: TCP on the address this host has on the
    route to the parent (what the clients dial), and no other interface.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    share_run_key()
    if initializer is not None:
        initializer(*initargs)
    if same_host:
        server = cls._Server(registry, None, authkey, serializer)
        writer.send(server.address)
    else:
        server = cls._Server(registry, (reachable_host(os.environ[ENV_HUB]), 0), authkey, serializer)
        writer.send(server.address)
    writer.close()
    server.serve_forever()


class _Handshaking:
    """A server's new connection until its client has authenticated.

    The stdlib's server reads the challenge answers with ``recv_bytes`` (the first
    says the client has spoken) and the first request, once the client is
    authenticated, with ``recv``: that ends the handshake's clock. ``close`` ends it too, before the descriptor is freed, so
    a late deadline never shuts down a descriptor reused by another connection.
    """

    def __init__(self, conn: Connection[Any, Any], handshakes: Handshakes, token: int) -> None:
        self._conn = conn
        self._handshakes = handshakes
        self._token = token

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        data = self._conn.recv_bytes(maxlength)
        self._handshakes.spoke(self._token)  # its answer to the challenge came
        return data

    def recv(self) -> Any:
        if not self._handshakes.done(self._token):
            raise EOFError("the handshake took too long, or too many were waiting")
        self.recv = self._conn.recv  # type: ignore[method-assign]  # the clock has stopped
        return self._conn.recv()

    def close(self) -> None:
        self._handshakes.done(self._token)
        self._conn.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def _xml_connection(conn: Connection[Any, Any]) -> Any:
    """``conn`` speaking XML-RPC, as the stdlib's ``XmlListener.accept`` returns it."""
    import xmlrpc.client

    std: Any = _std_connection
    std.xmlrpclib = xmlrpc.client  # the module global that XmlListener.accept sets
    return std.ConnectionWrapper(conn, std._xml_dumps, std._xml_loads)  # noqa: SLF001 - the stdlib managers' own XML serializer, used as they use it


class _Server(_std.Server):
    """The stdlib's manager server, with a listener that no client can stop or fill."""

    def accepter(self) -> None:
        handshakes = Handshakes()
        # The socket of the stdlib's SocketListener, which it keeps private.
        lsock = self.listener._listener._socket  # type: ignore[attr-defined]  # noqa: SLF001 - the stdlib Listener's socket, to close it under a blocked accept
        while (accepted := accept_retrying(lsock, handshakes, lambda: False, "the manager server")) is not None:
            sock, peer = accepted
            sock.setblocking(True)
            token = handshakes.admit(sock.fileno(), source_of(peer))
            raw: Any = Connection(sock.detach())
            if isinstance(self.listener, _std_connection.XmlListener):  # type: ignore[attr-defined]
                raw = _xml_connection(raw)  # serializer="xmlrpclib", as XmlListener.accept wraps it
            conn = _Handshaking(raw, handshakes, token)
            try:
                threading.Thread(target=self.handle_request, args=(conn,), daemon=True).start()
            except RuntimeError:  # no thread to be had: this connection goes, the server stays
                conn.close()


class BaseManager(_std.BaseManager):
    """:class:`multiprocessing.managers.BaseManager` whose server is a Fiber job.

    ``address`` and ``authkey`` default to a free port and the run's key. Pass an
    ``address`` to :meth:`connect` to an existing manager server.
    """

    _Server: ClassVar[type[_std.Server]] = _Server
    # Set by the stdlib's BaseManager, which typeshed declares without its private parts.
    _registry: ClassVar[dict[str, _RegistryEntry]]
    _finalize_manager: ClassVar[Callable[..., None]]
    _state: _StateRecord
    _authkey: bytes
    _serializer: str
    _address: Any
    _Client: Callable[..., Connection[Any, Any]]
    _shutdown_timeout: float  # set by the stdlib from 3.11, by __init__ below before

    def __init__(self, address: Any = None, authkey: bytes | None = None,
                 serializer: str = "pickle", ctx: Any = None, *,
                 shutdown_timeout: float = 1.0, backend: str | None = None) -> None:
        key = authkey if authkey is not None else share_run_key()
        if sys.version_info >= (3, 11):
            super().__init__(address, key, serializer, ctx,
                             shutdown_timeout=shutdown_timeout)
        else:  # the stdlib's manager has no shutdown_timeout before 3.11
            super().__init__(address, key, serializer, ctx)
            self._shutdown_timeout = shutdown_timeout
        self._backend = backend

    @classmethod
    def register(cls, typeid: str, callable: Callable | None = None, proxytype: Any = None,
                 exposed: Any = None, method_to_typeid: Any = None,
                 create_method: bool = True) -> None:
        """Register a type, as the stdlib does; a non-callable is refused at once."""
        if callable is not None and not builtins_callable(callable):
            raise TypeError(f"register({typeid!r}, ...): {callable!r} is not callable")
        if proxytype is None:
            proxytype = getattr(cls, "_default_proxytype", None)
        super().register(typeid, callable, proxytype, exposed, method_to_typeid, create_method)

    def start(self, initializer: Callable[..., object] | None = None,
              initargs: Iterable[Any] = ()) -> None:
        """Start the server as a job on the selected backend and wait for its address."""
        if self._state.value != State.INITIAL:
            if self._state.value == State.STARTED:
                raise ProcessError("Already started server")
            raise ProcessError("Manager has shut down")
        if initializer is not None and not builtins_callable(initializer):
            raise TypeError("initializer must be a callable")
        reader, writer = Pipe(duplex=False)

        self._process = Process(
            target=_serve, backend=self._backend,
            args=(type(self), self._registry, bytes(self._authkey), self._serializer, writer,
                  initializer, initargs, runtime().get_backend(self._backend).shares_this_machine))
        # Named as the stdlib names its manager's process, from the stdlib's private identity.
        identity = self._process._identity  # noqa: SLF001 - the stdlib's process identity, which names the manager's server as the stdlib's does
        self._process.name = f"{type(self).__name__}-{':'.join(map(str, identity))}"
        self._process.start()
        try:
            address = None
            if _poll_until_dead(reader, self._process):
                try:
                    address = reader.recv()
                except EOFError:  # the job ended before it connected: its end was given up
                    pass
            if address is None:
                self._process.join(5)
                tail = self._process.log_tail(15)
                raise FiberError(
                    f"manager server {self._process.name} exited with code "
                    f"{self._process.exitcode} before it was ready"
                    + (f"; the end of its log:\n{tail}" if tail else ""))
            self._address = address
        finally:
            reader.close()
        self._state.value = State.STARTED
        args: tuple[Any, ...] = (self._process, self._address, self._authkey, self._state, self._Client)
        if sys.version_info >= (3, 11):  # the stdlib's finalizer gained shutdown_timeout
            args += (self._shutdown_timeout,)
        self.shutdown = _std_util.Finalize(self, self._finalize_manager, args=args,
                                           exitpriority=0)

    # get_server() is the stdlib's: a server for these types that the caller runs in
    # this process (serve_forever); clients in jobs reach it like a started one.


def builtins_callable(obj: object) -> bool:
    return callable(obj)


def _poll_until_dead(reader: Any, process: Any) -> bool:
    """Wait for the server's address, or for the server job to end first."""
    while not reader.poll(0.05):
        if not process.is_alive():
            return reader.poll(0)
    return True


class SyncManager(BaseManager, _std.SyncManager):
    """The stdlib's SyncManager types (dict, list, Namespace, Value, Array, Queue,
    JoinableQueue, Lock, RLock, Event, Condition, Semaphore, BoundedSemaphore,
    Barrier, Pool), served by a Fiber job. ``Pool`` is a Fiber pool."""


class _SharedMemoryServer(_Server, _std.SharedMemoryServer):
    """The stdlib's server that tracks and unlinks shared memory blocks, with Fiber's listener."""


class SharedMemoryManager(BaseManager, _std.SharedMemoryManager):
    """The stdlib's SharedMemoryManager, its server a Fiber job on this host.

    ``SharedMemory(size)`` and ``ShareableList(sequence)`` create blocks in this
    process, and the server unlinks every one of them at ``shutdown()`` (or the end
    of a ``with`` block). Blocks live in this host's memory, so the server is a
    local job whatever backend is selected (``backend=`` overrides it).
    """

    _Server = _SharedMemoryServer

    def __init__(self, address: Any = None, authkey: bytes | None = None,
                 serializer: str = "pickle", ctx: Any = None, *,
                 shutdown_timeout: float = 1.0, backend: str | None = "local") -> None:
        super().__init__(address, authkey, serializer, ctx, shutdown_timeout=shutdown_timeout,
                         backend=backend)
        self._blocks: list[str] = []

    def start(self, initializer: Callable[..., object] | None = None,
              initargs: Iterable[Any] = ()) -> None:
        super().start(initializer, initargs)
        # Finalizers of one priority run newest first: this one stops the server, then
        # settles this process's resource tracker about the blocks the server unlinked.
        self.shutdown = _std_util.Finalize(self, _shutdown_and_settle,
                                           args=(self.shutdown, self._blocks), exitpriority=0)

    def SharedMemory(self, size: int) -> Any:  # noqa: N802 - the stdlib's name
        """A new block of ``size`` bytes, unlinked by the server at shutdown."""
        block = super().SharedMemory(size)
        self._blocks.append(block.name)
        return block

    def ShareableList(self, sequence: Any) -> Any:  # noqa: N802 - the stdlib's name
        """A new ShareableList of ``sequence``, unlinked by the server at shutdown."""
        shared = super().ShareableList(sequence)
        self._blocks.append(shared.shm.name)
        return shared


def _shutdown_and_settle(stop: Callable[[], None], blocks: list[str]) -> None:
    """Stop a SharedMemoryManager's server, then account here for what it unlinked.

    The blocks were made in this process, so its own resource tracker holds their
    names; the server, a job with a tracker of its own, unlinked them. A name the
    server did not get to (it was killed) is unlinked here instead.
    """
    stop()
    for name in blocks:
        try:
            block = _shared_memory.SharedMemory(name)
        except FileNotFoundError:
            _resource_tracker.unregister("/" + name, "shared_memory")
        else:
            block.close()
            block.unlink()
    blocks.clear()


def _pool_factory(*args: Any, **kwargs: Any) -> Any:

    return Pool(*args, **kwargs)


SyncManager.register("Pool", _pool_factory, _internals.PoolProxy)


def Manager(*, backend: str | None = None) -> SyncManager:  # noqa: N802
    """Start and return a :class:`SyncManager` (``multiprocessing.Manager()``)."""
    m = SyncManager(backend=backend)
    m.start()
    return m


class AsyncHandle:
    """The pending result of one asynchronous method call."""

    __slots__ = ("_event", "_ok", "_value", "_pipeline")

    def __init__(self, pipeline: _Pipeline | None = None) -> None:
        self._event = threading.Event()
        self._ok = False
        self._value: Any = None
        self._pipeline = pipeline

    def resolve(self, ok: bool, value: Any) -> None:
        """Give the call's result (``ok``) or exception: what the reader of its reply does."""
        self._ok, self._value = ok, value
        self._pipeline = None
        self._event.set()

    @property
    def resolved(self) -> bool:
        """Whether the reply is here, without reading any (unlike :meth:`ready`)."""
        return self._event.is_set()

    def ready(self) -> bool:
        pipeline = self._pipeline
        if pipeline is not None and not self._event.is_set():
            pipeline.read_arrived()  # nobody else may be reading the replies
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        pipeline = self._pipeline
        if pipeline is not None:
            pipeline.wait_for(self, timeout)
        return self._event.is_set()

    def get(self, timeout: float | None = None) -> Any:
        """The call's result; raises its exception, or TimeoutError after ``timeout`` s."""
        if not self.wait(timeout):
            raise TimeoutError(f"no reply within {timeout}s")
        if self._ok:
            return self._value
        raise self._value


class _Pipeline:
    """One connection per async proxy: requests go out at once, replies come back in order.

    There is no reader thread: whoever waits for a handle reads replies off the
    connection (under ``recv_lock``) and resolves the handles they belong to, in
    order, until its own is resolved. That saves a thread hand-off per call.
    """

    def __init__(self, conn: Connection[Any, Any], ident: str,
                 child: Callable[..., Any], lost: Callable[[], None]) -> None:
        """Over ``conn``, a new connection to the manager, for the proxied object ``ident``;
        ``child`` makes a proxy of a returned object, ``lost`` is called when the
        connection fails."""
        self.conn = conn
        self.ident = ident
        self.child = child
        self.lost = lost
        _internals.dispatch(self.conn, None, "accept_connection", (f"async-{ident}",))
        self.send_lock = threading.Lock()
        self.recv_lock = threading.Lock()
        self.waiting: collections.deque[AsyncHandle] = collections.deque()

    def call(self, methodname: str, args: tuple, kwds: dict) -> AsyncHandle:
        handle = AsyncHandle(self)
        with self.send_lock:
            self.waiting.append(handle)
            try:
                self.conn.send((self.ident, methodname, args, kwds))
            except Exception as e:
                self.waiting.pop()
                raise FiberError(f"the manager serving this object is gone: {e}") from e
        return handle

    def wait_for(self, handle: AsyncHandle, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not handle.resolved:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            # Another thread may be reading: it resolves our handle too if it comes first.
            if not self.recv_lock.acquire(timeout=0.005 if left is None else min(left, 0.005)):
                continue
            try:
                if handle.resolved:
                    return
                if left is not None and not self.conn.poll(left):
                    return
                self._read_one()
            finally:
                self.recv_lock.release()

    def read_arrived(self) -> None:
        """Resolve the handles whose replies are already here, unless another thread reads."""
        if not self.recv_lock.acquire(blocking=False):
            return
        try:
            while self.waiting and self.conn.poll(0):
                self._read_one()
        finally:
            self.recv_lock.release()

    def _read_one(self) -> None:
        try:
            kind, result = self.conn.recv()
        except Exception as e:
            err = FiberError(f"the manager serving this object is gone: {e!r}")
            with self.send_lock:
                pending, self.waiting = list(self.waiting), collections.deque()
                self.lost()
            for h in pending:
                h.resolve(False, err)
            return
        handle = self.waiting.popleft()
        if kind == "#RETURN":
            handle.resolve(True, result)
        elif kind == "#PROXY":
            handle.resolve(True, self.child(*result))
        else:
            handle.resolve(False, _internals.convert_to_error(kind, result))


class AsyncProxy(BaseProxy):
    """A proxy whose method calls return :class:`AsyncHandle` objects at once."""

    _pipeline: _Pipeline | None = None
    _pipeline_lock = threading.Lock()

    # Set by the stdlib's BaseProxy, which typeshed declares without its private parts.
    _token: Token
    _id: str
    _manager: BaseManager | None
    _serializer: str
    _authkey: bytes
    _Client: Callable[..., Connection[Any, Any]]
    _isauto: bool

    def _callmethod(  # type: ignore[override]  # returns a handle, not the result: the point of this class
            self, methodname: str, args: tuple = (), kwds: dict | None = None) -> AsyncHandle:
        pipeline = self._pipeline
        if pipeline is None:
            with AsyncProxy._pipeline_lock:
                pipeline = self._pipeline
                if pipeline is None:
                    try:
                        conn = self._Client(self._token.address, authkey=self._authkey)
                        pipeline = self._pipeline = _Pipeline(
                            conn, self._id, self._rebuild_child, self._drop_pipeline)
                    except OSError as e:
                        raise FiberError(
                            f"cannot reach the manager at {self._token.address!s}: it has shut "
                            f"down or its job ended ({e})") from e
        return pipeline.call(methodname, tuple(args), dict(kwds or {}))

    def _drop_pipeline(self) -> None:
        self._pipeline = None  # its connection failed: the next call opens another

    def _callmethod_sync(self, methodname: str, args: tuple = (), kwds: dict | None = None) -> Any:
        return super()._callmethod(methodname, args, kwds or {})

    def _rebuild_child(self, exposed: Any, token: Token) -> Any:
        typeid = cast(str, token.typeid)  # a registered name: typeshed's Token allows bytes or None
        # The manager's registry, read as the stdlib's BaseProxy._callmethod reads it.
        proxytype = self._manager._registry[typeid][-1] if self._manager else AsyncAutoProxy  # noqa: SLF001 - the stdlib BaseManager's registry of proxy types
        token.address = self._token.address
        proxy = proxytype(token, self._serializer, manager=self._manager, authkey=self._authkey,
                          exposed=exposed)
        conn = self._Client(token.address, authkey=self._authkey)
        _internals.dispatch(conn, None, "decref", (token.id,))
        return proxy

    def _getvalue(self) -> Any:
        return self._callmethod_sync("#GETVALUE")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} object, typeid {self._token.typeid!r} at {id(self):#x}>"

    def __str__(self) -> str:
        try:
            return self._callmethod_sync("__repr__")
        except Exception:
            return repr(self)[:-1] + "; '__str__()' failed>"

    def __reduce__(self) -> tuple:
        fn, args = BaseProxy.__reduce__(self)[:2]
        return fn, args


def _make_async_type(name: str, exposed: tuple) -> type:
    def make(method: str) -> Callable:
        def call(self: AsyncProxy, *args: Any, **kwds: Any) -> AsyncHandle:
            return self._callmethod(method, args, kwds)

        call.__name__ = method
        return call

    namespace: dict[str, Any] = {m: make(m) for m in exposed}
    namespace["_exposed_"] = exposed
    return type(name, (AsyncProxy,), namespace)


_async_types: dict[tuple[str | bytes | None, tuple[str, ...]], type] = {}


def AsyncAutoProxy(token: Token, serializer: str, manager: Any = None, authkey: bytes | None = None,  # noqa: N802
                   exposed: Any = None, incref: bool = True, manager_owned: bool = False) -> AsyncProxy:
    """Like the stdlib's AutoProxy, with asynchronous methods."""
    client = _internals.listener_client[serializer][1]
    if exposed is None:
        conn = client(token.address, authkey=authkey)
        try:
            exposed = _internals.dispatch(conn, None, "get_methods", (token,))
        finally:
            conn.close()
    if authkey is None and manager is not None:
        authkey = manager._authkey  # noqa: SLF001 - as the stdlib's AutoProxy reads it
    if authkey is None:
        authkey = _std_process.current_process().authkey
    key = (token.typeid, tuple(exposed))
    cls = _async_types.get(key)
    if cls is None:
        cls = _async_types[key] = _make_async_type(f"AsyncAutoProxy[{token.typeid!s}]", tuple(exposed))
    proxy = cls(token, serializer, manager=manager, authkey=authkey, incref=incref,
                manager_owned=manager_owned)
    proxy._isauto = True
    return proxy


class AsyncManager(BaseManager):
    """A :class:`BaseManager` whose proxies' methods return :class:`AsyncHandle` objects.

    Register your types as with ``BaseManager.register``; every call on a proxy
    returns at once, ``handle.get(timeout)`` returns that call's result or raises
    its exception. Handles may be collected in any order and from any thread.
    """

    _default_proxytype = AsyncAutoProxy
