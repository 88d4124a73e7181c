"""Attach or serve: how a synchronization object or a shared ctypes object reaches other processes.

Every such object is created with an operating-system resource on its creator's
host: a named POSIX semaphore (what :class:`multiprocessing.synchronize.SemLock`
itself uses under spawn) or a named POSIX shared-memory segment. When it is
pickled for another process (a Process argument, a Pool task, a Queue item), its
pickle carries both ways to reach it:

* the host it lives on and the names of its OS resources. A process on the same
  host that can open them (the same machine, and the names visible: a Docker
  container has its own ``/dev/shm`` and cannot, a process in a network
  namespace of this machine can) *attaches*: it uses the OS objects directly, at
  the speed of the stdlib;
* its creator's addresses and an object id. Any other process uses the *served*
  path: each operation is a request to the creator, which runs it on its own
  object, so served and attached users of one object see one state. An
  operation costs a round trip.

A thread of a process that uses served objects keeps one connection to each
creator (a *session*); the creator serves it in one thread of its own, so a lock
acquired through a session is owned by that thread, and an RLock's recursion, a
Condition's ``wait`` and ``notify`` (which must hold the lock) behave as they do
between threads. When a session ends (its thread or process ended, its host was
lost past ``peer_timeout``) the creator releases the locks it held for it, with
a warning: see :meth:`Served.end`.

The message kinds of a session (``SYNC_*``) are defined with the run's other kinds in
``fiber_core/wire/messages.py``. A *session* connects a thread of a *user* (a process
with served copies) to one *creator*; the user sends a request and waits for its
answer. A timeout of -1 means none.
"""

from __future__ import annotations

import _multiprocessing
import _posixshmem
import collections
import itertools
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable

from fiber_core.base import owned
from fiber_core.base.errors import FiberError, ForeignObjectError
from fiber_core.base.fds import readable
from fiber_core.base.log import log
from fiber_core.processes.process import current_process
from fiber_core.runtime.hub import Hub, dial
from fiber_core.runtime.run import outgoing_addresses, runtime
from fiber_core.wire.framing import Connection
from fiber_core.wire.messages import (
    SYNC_ACQUIRE,
    SYNC_ACTION,
    SYNC_CALL,
    SYNC_DONE,
    SYNC_HELLO,
    SYNC_NO,
    SYNC_RELEASE,
    SYNC_VALUE,
    SYNC_YES,
    decode_acquire,
    decode_call,
    decode_obj,
    encode_acquire,
    encode_call,
    encode_error,
    encode_release,
    raise_error,
)
from fiber_core.wire.serialize import dumps, loads

TARGET = "sync"
"""The hub target of sessions."""


# -- where an object lives ----------------------------------------------------------------


def _host_identity() -> str:
    """What tells this host from others: the kernel's boot id (containers share it)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        import uuid  # only where the kernel has no boot id (not Linux)

        return f"{socket.gethostname()}-{uuid.getnode():x}"


HOST = _host_identity()
"""This host. Processes with the same one may be able to open each other's named objects."""

TOKEN = os.urandom(8).hex()
"""This process, as the creator named in a :class:`Ref`."""

SERVED_ENV = "FIBER_SYNC_SERVED"
"""Set to 1, processes never attach: they use the served path even on the creator's host
(for tests and measurements of that path)."""


UID = os.geteuid()
"""This process's user: the owner of the semaphores and segments it creates."""


TYPE_CHECKING = False  # typing's own, without importing typing: the template preloads this module
if TYPE_CHECKING:
    from typing import Any, NamedTuple

    class Ref(NamedTuple):  # the record as type checkers see it; at run time, the one below
        token: str
        host: str
        addresses: str
        oid: int
        uid: int = UID
else:
    # The same record, made without typing.NamedTuple, which imports typing and compiles each
    # field's annotation when the class is made. tests/test_synchronize.py checks that both
    # name the same fields.
    Ref = collections.namedtuple("Ref", ("token", "host", "addresses", "oid", "uid"), defaults=(UID,),
                                 module=__name__)
    Ref.__doc__ = """Where a shared object is served: its creator, its id there, and the creator's user
    (a process that attaches to its named objects checks that they are that user's)."""


def may_attach(ref: Ref) -> bool:
    """Whether to try the OS objects named in a pickle from ``ref``'s creator."""
    return ref.host == HOST and os.environ.get(SERVED_ENV, "") in ("", "0")


_objects: weakref.WeakValueDictionary[tuple[str, int], Any] = weakref.WeakValueDictionary()
"""Every shared object this process has: the ones it created and served, and the ones
it received (one object per original, so a second copy sent here is the same object)."""

_registry = threading.Lock()
_oids = itertools.count(1)
_routed: Hub | None = None


def ref_for_pickle(obj: Any) -> Ref:
    """The :class:`Ref` to put in ``obj``'s pickle; in its creator, the first call serves it.

    The addresses are the ones the receiving job reaches the creator at
    (:func:`~fiber_core.runtime.run.outgoing_addresses`).
    """
    ref: Ref | None = obj.fiber_ref
    if ref is None:
        global _routed
        hub = runtime().hub
        with _registry:
            if _routed is not hub:
                hub.register(TARGET, _serve)
                _routed = hub
            ref = obj.fiber_ref
            if ref is None:
                ref = Ref(TOKEN, HOST, hub.addresses, next(_oids), UID)
                _objects[(TOKEN, ref.oid)] = obj
                obj.fiber_ref = ref
    if ref.token == TOKEN:
        return ref._replace(addresses=outgoing_addresses(ref.addresses))
    return ref


def known(ref: Ref) -> Any:
    """The object ``ref`` names if this process already has it (its creator, or a copy)."""
    return _objects.get((ref.token, ref.oid))


def remember(ref: Ref, obj: Any) -> Any:
    """Record ``obj``, just rebuilt from a pickle, as this process's object for ``ref``.

    Returns the one to use: another thread may have rebuilt it first.
    """
    with _registry:
        first = _objects.get((ref.token, ref.oid))
        if first is not None:
            return first
        obj.fiber_ref = ref
        _objects[(ref.token, ref.oid)] = obj
        return obj


# -- the OS objects ---------------------------------------------------------------------


def run_prefix(run_id: str) -> str:
    """What the names of a run's semaphores and segments start with (after the ``/``)."""
    return f"fb-{run_id}-"


def new_name() -> str:
    """A fresh name for a semaphore or segment (short: macOS allows 31 characters)."""
    return f"/{run_prefix(runtime().run_id)}{os.urandom(6).hex()}"


_TRACKER = """\
import sys
from _multiprocessing import sem_unlink
from _posixshmem import shm_unlink
names = set()
for line in sys.stdin.buffer:
    name = line[1:].decode().strip()
    if line[:1] == b"+":
        names.add(name)
    else:
        names.discard(name)


def drop_dir(path):
    # A directory that the processes of this host share, each holding a shared lock
    # on its .users file while it uses it: removed once none does. The lock of the
    # process this tracker served may take a moment to go with it.
    import fcntl, os, shutil, time
    for _ in range(100):
        try:
            fd = os.open(path + "/.users", os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            time.sleep(0.02)
            continue
        try:
            gone = "%s.gone-%d" % (path, os.getpid())
            os.rename(path, gone)
            shutil.rmtree(gone, ignore_errors=True)
        except OSError:
            pass
        os.close(fd)
        return


for name in names:
    try:
        kind, path = name[0], name[1:]
        if kind == "d":
            drop_dir(path)
        else:
            (sem_unlink if kind == "s" else shm_unlink)(path)
    except OSError:
        pass
"""


class _Tracker:
    """A small process that removes the names this process owns when it ends, however it ends.

    Like the stdlib's resource tracker, but silent and in a session of its own: a
    job ends with ``os._exit``, and may be killed with its process group (``kill()``,
    or its parent going away), and what it still owns is then removed all the same.
    It holds no stdout or stderr of this process (a job's forwarded output ends when
    the job does). It reads ``+KIND/NAME`` and ``-KIND/NAME`` lines until its pipe
    closes with this process, then removes what was not given back. KIND ``s`` is a
    semaphore, ``m`` a segment, ``d`` a directory of this host's broadcast copies
    (:func:`track_shared_dir`), removed only when no other process still uses it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._pid = 0
        self.tracker_pid = 0

    def _send(self, line: str) -> None:
        with self._lock:
            if self._fd is None or self._pid != os.getpid():
                self._fd, self._pid = self._start(), os.getpid()
            if self._fd >= 0:
                os.write(self._fd, line.encode())

    def _start(self) -> int:
        r, w = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _TRACKER], stdin=r,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            os.close(w)
            log.warning("fiber: cannot start %s to remove shared objects after a crash (%s): "
                        "they are removed when dropped or at a normal exit only", sys.executable, e)
            return -1
        finally:
            os.close(r)
        proc.returncode = 0  # never waited for: it ends after this process
        self.tracker_pid = proc.pid
        return w

    def register(self, name: str, kind: str) -> None:
        self._send(f"+{kind}{name}\n")

    def unregister(self, name: str, kind: str) -> None:
        try:
            self._send(f"-{kind}{name}\n")
        except OSError:  # late in the interpreter's exit
            pass


_tracker = _Tracker()


def _forget(name: str, kind: str) -> None:
    """Remove a name this process created (dropped here, or this process exits)."""
    try:
        if kind == "s":
            _multiprocessing.sem_unlink(name)
        else:
            _posixshmem.shm_unlink(name)
    except OSError:
        pass
    _tracker.unregister(name, kind)


def _own(owner: Any, name: str, kind: str) -> None:
    """``name`` (of kind ``s`` semaphore or ``m`` segment) is removed when ``owner`` is
    dropped or this process exits; if it exits without doing so, by the tracker."""
    _tracker.register(name, kind)
    weakref.finalize(owner, _forget, name, kind)


def track_shared_dir(path: str) -> None:
    """Have ``path`` removed when this process ends, if no process of this host uses it then.

    A user of the directory holds a shared ``flock`` on ``path/.users`` while it uses
    it; whoever can take that lock exclusively is the last user, and removes it.
    """
    _tracker.register(path, "d")


def create_semlock(owner: Any, kind: int, value: int, maxvalue: int) -> Any:
    """A new named semaphore (``_multiprocessing.SemLock``), removed with ``owner``."""
    runtime().expect_jobs()
    for _ in range(100):
        name = new_name()
        try:
            semlock = _multiprocessing.SemLock(kind, value, maxvalue, name, False)
        except FileExistsError:
            continue
        _own(owner, name, "s")
        return semlock
    raise FileExistsError("cannot find a free name for a semaphore")


def _foreign(what: str, name: str, creator: int, e: ForeignObjectError) -> ForeignObjectError:
    return ForeignObjectError(
        f"the {what} {name} of this host is not the one its creator (uid {creator}) made ({e}): the "
        f"creator removed it (it dropped the object, or ended) and another user made one under "
        f"its name. It is not used. Keep the object referenced in the process that created it "
        f"while other processes may receive it")


def _semaphore_file(name: str) -> str | None:
    """Where the named semaphore ``name`` lives (glibc's ``sem_open``), or None if unknown."""
    return f"/dev/shm/sem.{name.lstrip('/')}" if sys.platform == "linux" else None


def _semaphore_owner(path: str, owner: int) -> tuple[int, int]:
    """The identity of the semaphore file at ``path``, checked as ``owner``'s."""
    fd = os.open(path, os.O_RDONLY | owned.NOFOLLOW)
    try:
        st = owned.check(fd, "its file", uid=owner, private=False)
    finally:
        os.close(fd)
    return st.st_dev, st.st_ino


def attach_semlock(kind: int, maxvalue: int, name: str, owner: int = UID) -> Any:
    """The semaphore ``name`` of this host (``OSError`` if it cannot be opened here).

    :class:`ForeignObjectError` if it is not user ``owner``'s (its creator's). ``sem_open``
    gives no descriptor to check, so its file is checked before and after it is opened:
    another user cannot replace a file of the creator's (``/dev/shm`` is sticky), so the
    same file, the creator's, both times is the one opened.
    """
    path = _semaphore_file(name)
    try:
        before = _semaphore_owner(path, owner) if path else None
        # The stdlib's own way to open a named semaphore (its spawn start method's).
        semlock = _multiprocessing.SemLock._rebuild(0, kind, maxvalue, name)  # noqa: SLF001 - the stdlib rebuilds a named semaphore only this way
        if path and _semaphore_owner(path, owner) != before:
            raise ForeignObjectError("it was replaced while it was opened")
    except ForeignObjectError as e:
        raise _foreign("semaphore", name, owner, e) from None
    return semlock


class Segment:
    """A named POSIX shared-memory segment, mapped into this process (``buf``).

    The creator's is removed when it is dropped (the objects built on ``buf`` keep it
    alive) or when the creator exits; a process that attached never removes it.
    """

    __slots__ = ("name", "size", "buf", "__weakref__")

    def __init__(self, name: str, size: int, buf: mmap.mmap) -> None:
        self.name = name
        self.size = size
        self.buf = buf

    @classmethod
    def create(cls, size: int) -> Segment:
        length = max(size, 1)  # an empty mapping is not allowed
        runtime().expect_jobs()
        for _ in range(100):
            name = new_name()
            try:
                fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
            except FileExistsError:
                continue
            try:
                os.ftruncate(fd, length)
                buf = mmap.mmap(fd, length)
            except BaseException:
                _posixshmem.shm_unlink(name)
                raise
            finally:
                os.close(fd)
            segment = cls(name, size, buf)
            _own(segment, name, "m")
            return segment
        raise FileExistsError("cannot find a free name for a shared-memory segment")

    @classmethod
    def attach(cls, name: str, size: int, owner: int = UID) -> Segment:
        """Map the segment ``name`` of this host (``OSError`` if it cannot be opened here).

        :class:`ForeignObjectError` if it is not user ``owner``'s (its creator's). Unlike
        ``multiprocessing.shared_memory.SharedMemory(name)`` before Python 3.13, this does
        not register it with a resource tracker, which would remove it when this process exits.
        """
        length = max(size, 1)
        fd = _posixshmem.shm_open(name, os.O_RDWR | owned.NOFOLLOW, mode=0o600)
        try:
            try:
                st = owned.check(fd, "it", uid=owner, private=False)
            except ForeignObjectError as e:
                raise _foreign("shared-memory segment", name, owner, e) from None
            if st.st_size < length:
                raise OSError(f"shared-memory segment {name} is smaller than expected")
            buf = mmap.mmap(fd, length)
        finally:
            os.close(fd)
        return cls(name, size, buf)


# -- the user's side of the served path ----------------------------------------------------


_sessions = threading.local()


class _Session:
    """This thread's connection to one creator."""

    def __init__(self, ref: Ref) -> None:
        sock = dial(ref.addresses, runtime().authkey, TARGET)
        self.conn = Connection(sock)
        try:
            who = (f"{current_process().name} (pid {os.getpid()} on {socket.gethostname()}), "
                   f"thread {threading.current_thread().name}")
            self.conn.send_bytes(SYNC_HELLO + who.encode())
        except BaseException:
            self.conn.close()
            raise

    def request(self, frame: bytes, action: Callable[[], Any] | None) -> bytes:
        conn = self.conn
        conn.send_bytes(frame)
        while True:
            reply = conn.recv_bytes()
            if reply[:1] != SYNC_ACTION:
                return reply
            try:
                if action is not None:
                    action()
                answer = SYNC_DONE
            except Exception as e:
                answer = encode_error(e)
            conn.send_bytes(answer)

    def __del__(self) -> None:
        conn = getattr(self, "conn", None)  # None if dialing failed
        if conn is not None:
            conn.close()


class Remote:
    """The handle of an object served by its creator: each call is one round trip."""

    __slots__ = ("ref", "what")

    def __init__(self, ref: Ref, what: str) -> None:
        self.ref = ref
        self.what = what

    def _request(self, frame: bytes, action: Callable[[], Any] | None = None) -> bytes:
        ref = self.ref
        sessions: dict[str, _Session] | None = getattr(_sessions, "by_creator", None)
        if sessions is None:
            sessions = _sessions.by_creator = {}
        session = sessions.get(ref.token)
        try:
            if session is None:
                session = sessions[ref.token] = _Session(ref)
            return session.request(frame, action)
        except BaseException as e:
            # An answer may still be on its way (an interrupt): the session cannot go on.
            # Whatever this thread held through it is released by the creator when it
            # sees the connection end; a later call starts afresh.
            dropped = sessions.pop(ref.token, None)
            if dropped is not None:
                dropped.conn.close()
            if isinstance(e, (EOFError, OSError)):
                raise FiberError(
                    f"the process that created this {self.what} has exited or cannot be "
                    f"reached ({e}); a shared object works as long as its creator runs") from e
            raise

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        reply = self._request(encode_acquire(self.ref.oid, block, timeout))
        if reply == SYNC_YES:
            return True
        if reply == SYNC_NO:
            return False
        raise_error(reply)
        raise AssertionError  # unreachable

    def release(self) -> None:
        reply = self._request(encode_release(self.ref.oid))
        if reply != SYNC_DONE:
            raise_error(reply)

    def call(self, op: str, *args: Any, action: Callable[[], Any] | None = None) -> Any:
        reply = self._request(encode_call(self.ref.oid, op, args), action)
        if reply[:1] == SYNC_VALUE:
            return loads(memoryview(reply)[1:])
        raise_error(reply)


# -- the creator's side ------------------------------------------------------------------------


_SLICE = 0.2  # seconds between checks, in a blocking wait, that the user still waits


Lost = tuple[str, Callable[[], None]]
"""What a session still held of an object when it ended: what it is, and how to release it."""


class PeerGone(Exception):
    """The user of a session went away while the creator worked for it."""


_serving = threading.local()


def serving() -> Served | None:
    """The session the current thread serves, if it is a creator's session thread."""
    return getattr(_serving, "session", None)


class Served:
    """The creator's end of one session: the objects it used and what it holds of them.

    A served object implements, for the operations its class allows, the public serving
    protocol: ``serve_acquire(served, block, timeout) -> bool``, ``serve_release(served)``,
    ``serve_call(served, op, args) -> result``, and ``serve_lost(served) -> Lost | None``:
    what the session still holds, and how to release it, when the session ends. It also
    has a ``fiber_ref`` attribute (``None`` until :func:`ref_for_pickle` or
    :func:`remember` sets it): the :class:`Ref` it is shared under.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.conn = Connection(sock)
        self.who = "a process"
        self.objects: dict[int, Any] = {}  # keeps what it used alive while it lasts
        self.held: dict[int, int] = {}  # id(object) -> acquisitions not released through it

    def peer_gone(self) -> bool:
        """Whether the user closed the connection (it sends nothing while it waits)."""
        try:
            return readable(self.sock) and self.sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def blocking(self, attempt: Callable[[float], bool], timeout: float | None) -> bool:
        """Call ``attempt(seconds)`` until it succeeds or ``timeout`` passes, in short
        slices; raise :class:`PeerGone` if the user goes away meanwhile."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            left = _SLICE if end is None else min(_SLICE, end - time.monotonic())
            if attempt(max(left, 0.0)):
                return True
            if end is not None and time.monotonic() >= end:
                return False
            if self.peer_gone():
                raise PeerGone

    def run_action(self) -> None:
        """Have the user run its Barrier's action; raise what it raised there."""
        try:
            self.conn.send_bytes(SYNC_ACTION)
            answer = self.conn.recv_bytes()
        except (EOFError, OSError) as e:
            raise FiberError(f"{self.who} ended while it ran the barrier's action") from e
        if answer != SYNC_DONE:
            raise_error(answer)

    def count(self, obj: Any, delta: int) -> None:
        """Count an acquisition (+1) or release (-1) of ``obj`` through this session."""
        key = id(obj)
        self.held[key] = max(0, self.held.get(key, 0) + delta)

    def obj(self, oid: int) -> Any:
        obj = self.objects.get(oid)
        if obj is None:
            obj = _objects.get((TOKEN, oid))
            if obj is None:
                raise FiberError(
                    "this shared object no longer exists in the process that created it: the "
                    "creator must keep a reference to it while other processes use it")
            self.objects[oid] = obj
        return obj

    def handle(self, frame: bytes) -> bytes:
        code = frame[:1]
        if code == SYNC_ACQUIRE:
            oid, block, timeout = decode_acquire(frame)
            return SYNC_YES if self.obj(oid).serve_acquire(self, block, timeout) else SYNC_NO
        if code == SYNC_RELEASE:
            self.obj(decode_obj(frame)).serve_release(self)
            return SYNC_DONE
        if code == SYNC_CALL:
            oid, op, args = decode_call(frame)
            return SYNC_VALUE + dumps(self.obj(oid).serve_call(self, op, args))
        raise FiberError(f"unexpected message {bytes(code)!r} on a shared-object session: every "
                         "process of a run must use the same version of Fiber")

    def end(self) -> None:
        """Release what the user still held (its thread or process ended, or its host was
        lost): a lock nobody can release any more would stop the run forever."""
        lost: list[Lost] = []
        for obj in self.objects.values():
            try:
                held = obj.serve_lost(self)
            except Exception:
                log.exception("fiber: cannot tell what %s held of %r", self.who, obj)
                continue
            if held is not None:
                lost.append(held)
        if lost:
            log.warning("fiber: %s ended while it held %s; releasing (this process created "
                        "and serves them, and saw the connection end)", self.who,
                        ", ".join(what for what, _ in lost))
        for what, release in lost:
            try:
                release()
            except Exception:
                log.exception("fiber: releasing %s that %s held failed", what, self.who)
        self.objects.clear()


def _serve(target: str, sock: socket.socket) -> None:
    """Serve one session in the hub thread that accepted it, until it ends."""
    served = Served(sock)
    _serving.session = served
    conn = served.conn
    try:
        while True:
            frame = conn.recv_bytes()
            if frame[:1] == SYNC_HELLO:
                served.who = bytes(frame[1:]).decode("utf-8", "replace")
                continue
            try:
                reply = served.handle(frame)
            except PeerGone:
                break
            except Exception as e:
                reply = encode_error(e)
            conn.send_bytes(reply)
    except (EOFError, OSError):
        pass
    finally:
        _serving.session = None
        served.end()
        conn.close()
