"""Authenticated message connections between the processes of a run.

Every byte stream between two processes of a Fiber program is a plain socket: a
Unix socket when both ends are on one host, TCP otherwise. A connection starts
with a mutual challenge-response over HMAC-SHA256 with the run's secret key, and
nothing is unpickled before it succeeds, so a stranger who reaches an open port
gets nothing run. After that, messages are length-prefixed frames.

This module also holds :func:`Pipe` and :func:`wait`, the counterparts of
:func:`multiprocessing.Pipe` and :func:`multiprocessing.connection.wait`.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import pickle
import selectors
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterable
from types import CodeType, FunctionType
from typing import Any

from fiber_core.errors import AuthenticationError, PicklingError

_MAGIC = b"FIBR\x01"
_NONCE = 16
_MAC = 32
_HANDSHAKE_TIMEOUT = 10.0
_HEADER = struct.Struct("!I")
_BIG = 0xFFFFFFFF
_BIG_HEADER = struct.Struct("!Q")
_SMALL = 64 * 1024


# Exact types that cloudpickle pickles exactly as pickle does (the C pickler handles
# them before it asks cloudpickle); for small messages plain pickle is ~4x faster.
# Not for big ones: pickle.dumps slows down sharply past its 64 KiB frame size.
_SCALARS = frozenset({type(None), bool, int, float})
_BUFFERS = frozenset({str, bytes, bytearray})


def _small_plain(obj: Any) -> bool:
    t = type(obj)
    if t in _SCALARS:
        return True
    if t in _BUFFERS:
        return len(obj) <= _SMALL
    if (t is tuple or t is list) and len(obj) <= 16:
        for x in obj:
            tx = type(x)
            if tx not in _SCALARS and (tx not in _BUFFERS or len(x) > 4096):
                return False
        return True
    return False


class _ByValue(Exception):
    """``obj`` holds something that only cloudpickle can send."""


_MAIN_MODULES = frozenset({"__main__", "__mp_main__"})


class _Pickler(pickle.Pickler):
    """The C pickler, with what the main module defines sent both by name and by value.

    ``reducer_override`` sees neither builtin containers nor scalars, so plain data
    pickles at full speed. A function or class defined at the top of the main
    module goes as :func:`_main_object`: the receiving job uses its own copy when it
    imported the same main module (as multiprocessing's spawn does, and without
    loading cloudpickle), or else the cloudpickle copy sent along. Anything else
    from the main module (a method, a nested class) is refused: cloudpickle then
    pickles the whole object.
    """

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, FunctionType)) and getattr(obj, "__module__", None) in _MAIN_MODULES:
            name = obj.__qualname__
            if "." in name or "<" in name:
                raise _ByValue
            import cloudpickle

            blob = cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            return _main_object, (name, _fingerprint(obj), blob)
        return NotImplemented


def _code_key(code: CodeType, parts: list[bytes]) -> None:
    parts += (code.co_code, b"%d" % code.co_firstlineno, " ".join(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, CodeType):
            _code_key(const, parts)
        elif isinstance(const, frozenset):  # its order follows this process's string hashes
            parts.append(repr(sorted(map(repr, const))).encode())
        else:
            parts.append(repr(const).encode())


def _fingerprint(obj: Any) -> bytes:
    """What tells a main-module function or class from another of the same name.

    The bytecode, constants, names and first line of a function (so one redefined
    under ``if __name__ == "__main__":`` differs from the module's), and for a
    class, its name and those of its methods. Not the file name: the job may reach
    the same file by another path.
    """
    parts = [obj.__qualname__.encode()]
    if isinstance(obj, FunctionType):
        _code_key(obj.__code__, parts)
    else:
        parts.append(b"%d" % getattr(obj, "__firstlineno__", 0))
        for key, value in sorted(vars(obj).items()):
            func = getattr(value, "__func__", value)  # staticmethod, classmethod
            if isinstance(func, FunctionType):
                parts.append(key.encode())
                _code_key(func.__code__, parts)
    return hashlib.blake2b(b"\0".join(parts), digest_size=16).digest()


def _main_object(name: str, fingerprint: bytes, blob: bytes) -> Any:
    """Unpickle a main-module function or class: this job's own copy if it has the same one."""
    main = sys.modules.get("__main__")
    obj = getattr(main, name, None)
    if isinstance(obj, (type, FunctionType)) and _fingerprint(obj) == fingerprint:
        return obj
    return pickle.loads(blob)


_picklers = threading.local()  # a pickler per thread, reused: making one costs twice a dump


def _plain_dumps(obj: Any) -> bytes:
    reusable = getattr(_picklers, "free", None)
    _picklers.free = None  # taken (a nested dump, from a __reduce__, makes its own)
    if reusable is None:
        buf = io.BytesIO()
        pickler = _Pickler(buf, pickle.HIGHEST_PROTOCOL)
    else:
        buf, pickler = reusable
    try:
        pickler.dump(obj)
        data = buf.getvalue()
    finally:
        pickler.clear_memo()  # the memo would keep what was pickled alive
        if buf.tell() <= _SMALL * 16:  # a big buffer is not kept
            buf.seek(0)
            buf.truncate()
            _picklers.free = (buf, pickler)
    return data


def dumps(obj: Any) -> bytes:
    """Pickle ``obj`` for another process (cloudpickle: lambdas and ``__main__`` work)."""
    if _small_plain(obj):
        return pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    cp = sys.modules.get("cloudpickle")
    if cp is None or not getattr(cp.cloudpickle, "_PICKLE_BY_VALUE_MODULES", True):
        try:
            return _plain_dumps(obj)
        except Exception:
            pass  # a lambda, a closure, a local or __main__ class: by value, then
    import cloudpickle  # on first use: a job that sends only plain data starts without it

    try:
        return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise PicklingError(
            f"cannot send {type(obj).__name__} object to another process: {e}"
        ) from e


loads = pickle.loads


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.digest(key, b"".join(parts), "sha256")


_WAITALL = getattr(socket, "MSG_WAITALL", 0)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    # Usually one syscall and no copy: the kernel waits until all n bytes are there.
    data = sock.recv(n, _WAITALL)
    if len(data) == n:
        return data
    if not data:
        raise EOFError("connection closed by the other process")
    # A short read (a signal, a socket with a timeout): fill in the rest.
    buf = bytearray(n)
    view = memoryview(buf)
    got = len(data)
    view[:got] = data
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("connection closed by the other process")
        got += k
    return bytes(buf)


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


def keepalive(sock: socket.socket, idle: float, interval: float, count: int) -> None:
    """Have the kernel drop a TCP connection whose peer stopped answering.

    Probes start after ``idle`` seconds of silence, every ``interval`` seconds, and
    the connection fails after ``count`` unanswered ones, or once sent data has gone
    unacknowledged for ``idle + interval * count`` seconds. Options this system
    lacks are skipped.
    """
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", max(1, round(idle))),
                        ("TCP_KEEPINTVL", max(1, round(interval))),
                        ("TCP_KEEPCNT", max(1, count)),
                        ("TCP_USER_TIMEOUT", max(1000, round((idle + interval * count) * 1000)))):
        opt = getattr(socket, name, None)
        if opt is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
            except OSError:
                pass


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
    from fiber_core.config import config

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


class Connection:
    """A message connection with the API of :class:`multiprocessing.connection.Connection`."""

    def __init__(self, sock: socket.socket | None, readable: bool = True, writable: bool = True) -> None:
        self._sock = sock
        self._readable = readable
        self._writable = writable
        self._closed = False

    # Subclasses that connect lazily override this.
    def _socket(self) -> socket.socket:
        if self._closed or self._sock is None:
            raise OSError("handle is closed")
        return self._sock

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def readable(self) -> bool:
        return self._readable

    @property
    def writable(self) -> bool:
        return self._writable

    def fileno(self) -> int:
        return self._socket().fileno()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._sock is not None:
                try:
                    self._sock.close()
                finally:
                    self._sock = None

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_writable(self) -> None:
        if not self._writable:
            raise OSError("connection is read-only")

    def _check_readable(self) -> None:
        if not self._readable:
            raise OSError("connection is write-only")

    def send_bytes(self, buf: Any, offset: int = 0, size: int | None = None) -> None:
        self._check_writable()
        if type(buf) is bytes and offset == 0 and size is None:  # the usual case
            self._send(buf)
            return
        view = memoryview(buf).cast("B")
        n = len(view)
        if offset < 0 or offset > n:
            raise ValueError("offset is out of bounds")
        if size is None:
            size = n - offset
        if size < 0 or offset + size > n:
            raise ValueError("size is out of bounds")
        self._send(view[offset:offset + size])

    def _send(self, data: memoryview | bytes, head: bytes = b"") -> None:
        """Send one frame of ``head + data``; a big ``data`` is not copied."""
        sock = self._socket()
        n = len(head) + len(data)
        if n >= _BIG:
            header = _HEADER.pack(_BIG) + _BIG_HEADER.pack(n)
        else:
            header = _HEADER.pack(n)
        if n <= _SMALL:
            sock.sendall(header + head + data)
        else:
            sock.sendall(header + head)
            sock.sendall(data)

    def _recv(self, maxlength: int | None = None) -> bytes:
        sock = self._socket()
        (n,) = _HEADER.unpack(_recv_exact(sock, 4))
        if n == _BIG:
            (n,) = _BIG_HEADER.unpack(_recv_exact(sock, 8))
        if maxlength is not None and n > maxlength:
            self.close()
            raise OSError("bad message length")
        return _recv_exact(sock, n) if n else b""

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        self._check_readable()
        if maxlength is not None and maxlength < 0:
            raise ValueError("negative maxlength")
        return self._recv(maxlength)

    def recv_bytes_into(self, buf: Any, offset: int = 0) -> int:
        from multiprocessing import BufferTooShort

        self._check_readable()
        data = self._recv()
        view = memoryview(buf).cast("B")
        if offset < 0 or offset > len(view):
            raise ValueError("negative offset" if offset < 0 else "offset too large")
        if len(data) > len(view) - offset:
            raise BufferTooShort(data)
        view[offset:offset + len(data)] = data
        return len(data)

    def send(self, obj: Any) -> None:
        self._check_writable()
        self._send(dumps(obj))

    def recv(self) -> Any:
        self._check_readable()
        return loads(self._recv())

    def poll(self, timeout: float | None = 0.0) -> bool:
        self._check_readable()
        return bool(wait([self], timeout))


class FrameReader:
    """Reads the frames of a :class:`Connection`'s peer with as few syscalls as it can.

    It reads ahead, so several small frames usually come out of one ``recv``. The
    socket's readiness then no longer tells whether a frame is waiting: use it only
    for a socket that nothing polls, such as one a thread serves until EOF.
    """

    def __init__(self, sock: socket.socket, chunk: int = _SMALL) -> None:
        self._sock = sock
        self._chunk = chunk
        self._buf = b""
        self._pos = 0

    def buffered(self) -> bool:
        """Whether a whole frame is already here (``recv_bytes`` will not block)."""
        buf, pos = self._buf, self._pos
        if len(buf) - pos < 4:
            return False
        (n,) = _HEADER.unpack_from(buf, pos)
        return n != _BIG and pos + 4 + n <= len(buf)

    def recv_bytes(self) -> bytes | bytearray:
        """The next frame: ``bytes``, or for a frame bigger than ``chunk``, a ``bytearray``."""
        buf, pos = self._buf, self._pos
        while True:
            avail = len(buf) - pos
            if avail >= 4:
                (n,) = _HEADER.unpack_from(buf, pos)
                start = pos + 4
                if n == _BIG:
                    if avail >= 12:
                        (n,) = _BIG_HEADER.unpack_from(buf, start)
                        start += 8
                    else:
                        n = -1
                if n >= 0:
                    end = start + n
                    if end <= len(buf):
                        self._buf, self._pos = buf, end
                        return buf[start:end]
                    if n > self._chunk:  # a big frame: the rest straight into place, no copies
                        self._buf, self._pos = b"", 0
                        return self._recv_big(buf[start:], n)
            chunk = self._sock.recv(self._chunk)
            if not chunk:
                self._buf, self._pos = b"", 0
                raise EOFError("connection closed by the other process")
            buf = buf[pos:] + chunk if pos < len(buf) else chunk
            pos = 0

    def _recv_big(self, head: bytes, n: int) -> bytearray:
        data = bytearray(n)
        got = len(head)
        data[:got] = head
        view = memoryview(data)
        while got < n:
            k = self._sock.recv_into(view[got:], n - got, _WAITALL)
            if k == 0:
                raise EOFError("connection closed by the other process")
            got += k
        return data


def wait(object_list: Iterable[Any], timeout: float | None = None) -> list[Any]:
    """Like :func:`multiprocessing.connection.wait`: the objects that are ready to read.

    Accepts Fiber connections, sockets, file descriptors and objects with ``fileno()``.
    """
    objects = list(object_list)
    with selectors.DefaultSelector() as sel:
        for obj in objects:
            sel.register(obj, selectors.EVENT_READ)
        ready = sel.select(timeout)
    return [key.fileobj for key, _ in ready]


# -- Pipe ---------------------------------------------------------------------------


class _PipeState:
    """Creator-side state of one Pipe: where each end lives, and its socket once known."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent = [False, False]  # end i was pickled to another process
        self.socks: list[socket.socket | None] = [None, None]
        self.arrived = [threading.Event(), threading.Event()]
        self.waiting: dict[int, socket.socket] = {}
        self.dialed = [False, False]  # end i, sent away, has connected back

    def abandon(self, index: int) -> None:
        """End ``index`` was sent to a process that ended: if it never connected,
        its peer sees end-of-file instead of waiting forever."""
        other = 1 - index
        with self.lock:
            if self.dialed[index]:
                return
            self.dialed[index] = True
            if not self.sent[other]:
                a, b = socket.socketpair()
                b.close()
                self.socks[other] = a
                self.arrived[other].set()
            elif other in self.waiting:
                self.waiting.pop(other).close()


class PipeEnd(Connection):
    """One end of a :func:`Pipe`. It connects on first use, wherever it is."""

    def __init__(self, hub: str, pipe_id: str, index: int,
                 readable: bool, writable: bool, state: _PipeState | None) -> None:
        super().__init__(None, readable, writable)
        self._hub = hub
        self._pipe_id = pipe_id
        self._index = index
        self._state = state  # set only in the creating process

    def __reduce__(self) -> tuple:
        if self._sock is not None or self._closed:
            raise PicklingError(
                "a Pipe end can be sent to another process only before it is used or closed here"
            )
        if self._state is not None:
            with self._state.lock:
                self._state.sent[self._index] = True
            from fiber_core.process import pickling_for

            run = pickling_for()
            if run is not None:
                state, index = self._state, self._index
                run.on_finish(lambda: state.abandon(index))
        from fiber_core.runtime import outgoing_addresses

        hub = outgoing_addresses(self._hub) if self._state is not None else self._hub
        return (_rebuild_pipe_end, (hub, self._pipe_id, self._index, self._readable, self._writable))

    def _socket(self) -> socket.socket:
        if self._closed:
            raise OSError("handle is closed")
        if self._sock is None:
            self._sock = self._connect()
        return self._sock

    def _connect(self, timeout: float | None = None) -> socket.socket:
        state = self._state
        if state is None:  # this end was sent here: dial the creator
            from fiber_core.runtime import runtime

            return dial(self._hub, runtime().authkey, f"pipe:{self._pipe_id}:{self._index}")
        other = 1 - self._index
        with state.lock:
            if state.sent[self._index]:  # its socket went with it: waiting here would hang
                raise OSError("this Pipe end was sent to another process; use it there, not here")
            if state.socks[self._index] is None and not state.sent[other]:
                a, b = socket.socketpair()
                state.socks[self._index], state.socks[other] = a, b
                state.arrived[0].set()
                state.arrived[1].set()
        if not state.arrived[self._index].wait(timeout):
            raise TimeoutError
        sock = state.socks[self._index]
        assert sock is not None
        return sock

    def poll(self, timeout: float | None = 0.0) -> bool:
        self._check_readable()
        if self._sock is None and self._state is not None:
            start = time.monotonic()
            try:
                self._sock = self._connect(timeout)
            except TimeoutError:
                return False
            if timeout is not None:
                timeout = max(0.0, timeout - (time.monotonic() - start))
        return super().poll(timeout)


def _rebuild_pipe_end(hub: str, pipe_id: str, index: int, readable: bool, writable: bool) -> PipeEnd:
    end = PipeEnd(hub, pipe_id, index, readable, writable, None)
    # Connect at once, so that the creator sees EOF if this process dies later.
    end._sock = end._connect()
    return end


def _pipe_route(state: _PipeState, target: str, sock: socket.socket) -> None:
    index = int(target.rsplit(":", 1)[1])
    other = 1 - index
    with state.lock:
        if state.dialed[index]:  # a second copy of the same end, or one given up on
            sock.close()
            return
        state.dialed[index] = True
        if not state.sent[other]:
            state.socks[other] = sock
            state.arrived[other].set()
            return
        if other in state.waiting:
            peer = state.waiting.pop(other)
        else:
            state.waiting[index] = sock
            return
    _splice(sock, peer)


def _splice(a: socket.socket, b: socket.socket) -> None:
    """Relay bytes both ways between two sockets (both ends of a Pipe left the creator)."""

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    threading.Thread(target=pump, args=(a, b), daemon=True, name="fiber-pipe-relay").start()
    threading.Thread(target=pump, args=(b, a), daemon=True, name="fiber-pipe-relay").start()


def Pipe(duplex: bool = True) -> tuple[PipeEnd, PipeEnd]:
    """Return a pair of connected ends, like :func:`multiprocessing.Pipe`.

    The ends can be given to any processes of the program, on any host. When both
    ends stay in one process they are a local socket pair; when one end is sent to
    a child, the child connects straight to this process.
    """
    from fiber_core.runtime import runtime

    rt = runtime()
    pipe_id = os.urandom(16).hex()
    state = _PipeState()
    rt.hub.register_prefix(f"pipe:{pipe_id}:", lambda target, sock: _pipe_route(state, target, sock))
    a = PipeEnd(rt.hub.addresses, pipe_id, 0, True, duplex, state)
    b = PipeEnd(rt.hub.addresses, pipe_id, 1, duplex, True, state)
    return a, b


__all__ = ["Connection", "FrameReader", "Pipe", "PipeEnd", "dial", "dumps", "loads", "wait"]
