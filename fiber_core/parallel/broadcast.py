"""Broadcast: a big read-only value published once, fetched at most once per host, mapped by every job there.

The program publishes a value and gets a :class:`Broadcast`, a handle that pickles to
a few hundred bytes and travels as a ``Process`` argument, a Pool task or initializer
argument, or a Queue item. In any process, ``handle.value`` is the newest version::

    import numpy as np
    import fiber_core as fiber

    def work(args):
        table, i = args
        return float(table.value[i])     # a read-only view, no copy

    if __name__ == "__main__":
        table = fiber.broadcast(np.arange(1_000_000, dtype=np.float32))
        with fiber.Pool(4) as pool:
            print(pool.map(work, [(table, i) for i in range(4)]))   # [0.0, 1.0, 2.0, 3.0]
        table.publish(np.zeros(1_000_000, dtype=np.float32))        # version 2

**Versions.** Each :meth:`Broadcast.publish` makes a new version; a reader sees it from
its next read of ``.value``, and always a whole version, never a mix of two. The
reader's :attr:`Broadcast.version` says which version its last read gave.

**One copy per host.** A version is a *segment*: a file on ``/dev/shm`` in a directory
that the run's processes on one host share (``/dev/shm/fiber-bc-<run>-<tag>``, one per
machine where the backend tells its jobs' machines apart with ``FIBER_JOB_HOST``: see
:func:`store_name`).
The publisher writes each version into its own host's directory, so its local jobs
map it without any transfer. Elsewhere, the first reader on a host fetches the version
from the publisher over an authenticated connection of its own (not the Pool's) and
renames it into place only once it is whole; the other readers there wait for it and
map it. A reader whose ``/dev/shm`` is private (a pod, a container of its own) or full
keeps a copy of its own (``handle.shared`` is False) and logs once that it does.

**Other users of the host.** The directory's name is derived from the run's key, so no
one outside the run can make it first; it is made with mode 0700, and one that exists is
used only if it is this user's and closed to others (else a warning names it and the
process keeps its own copy). Its files are made with ``O_EXCL`` under random names and
opened without following links, owner checked. A segment's header, region table and
pickle stream carry a MAC with the run's key, checked before anything is unpickled.

**What a read gives.** numpy arrays, in the value or nested in it, come back as
read-only views of the segment (pickle protocol 5's out-of-band buffers); a ``bytes``,
``bytearray``, ``memoryview`` or ``array.array`` value comes back as a read-only
``memoryview`` of it; anything else is unpickled once per process per version.

**Memory.** The publisher keeps the current version only. A host's directory is
removed when the last process of the run that used it there ends, however it ends (a
small tracker process per user removes it: see
:func:`fiber_core.parallel.sharing.track_shared_dir`), so a killed program leaves no
segment once its jobs are gone. A version replaced or closed by the publisher is
removed on the publisher's host at once and on other hosts at their next read.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import mmap
import os
import pickle
import struct
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from fiber_core.base import owned
from fiber_core.base.errors import FiberError, ForeignObjectError
from fiber_core.base.log import log
from fiber_core.contract.env import ENV_JOB_HOST
from fiber_core.parallel.sharing import (
    HOST,
    TOKEN,
    Lost,
    Ref,
    Remote,
    Served,
    known,
    ref_for_pickle,
    remember,
    track_shared_dir,
)
from fiber_core.runtime.hub import Hub, dial
from fiber_core.runtime.run import runtime
from fiber_core.wire.auth import mac, mac_matches
from fiber_core.wire.framing import Connection
from fiber_core.wire.serialize import dumps

TARGET = "broadcast"
"""The hub target on which a publisher sends whole versions."""

SHM_ROOT = "/dev/shm"

_CHUNK = 4 << 20  # bytes per send: a transfer never needs a second copy of the version
_ALIGN = 64  # numpy's arrays want aligned data
_MAGIC = b"FBC2"
_HEAD = struct.Struct("!4sQII")  # magic, version, kind, number of regions; then the MAC
_MAC = 32  # a MAC (auth.mac: keyed BLAKE2b) with the run's key of the header, the region table and the stream
_SEGMENT_LABEL = b"fiber broadcast segment\0"
_DIR_LABEL = b"fiber broadcast directory\0"
_REGION = struct.Struct("!QQ")  # offset, length
_PICKLED, _RAW = 0, 1
_FETCH = struct.Struct("!Q")  # the object id asked for
_ANSWER = struct.Struct("!QQ")  # version, size


# -- a version's bytes ---------------------------------------------------------------------


def _raw_view(value: Any) -> memoryview | None:
    """A contiguous view of a value that is served as a plain buffer, else None."""
    if not isinstance(value, (bytes, bytearray, memoryview, array.array, mmap.mmap)):
        return None
    view = memoryview(value)
    return view if view.c_contiguous else memoryview(view.tobytes())


def _encode(value: Any) -> tuple[int, bytes, list[memoryview]]:
    """``value`` as a kind, a pickle stream and the buffers it refers to (not copied)."""
    raw = _raw_view(value)
    if raw is not None:
        fmt: Any = raw.format
        shape: Any = raw.shape
        try:
            raw.cast("B").cast(fmt, shape)
        except (TypeError, ValueError):  # a format memoryview cannot cast to: bytes, then
            fmt, shape = "B", (raw.nbytes,)
        return _RAW, pickle.dumps((fmt, shape)), [raw.cast("B")]
    buffers: list[pickle.PickleBuffer] = []
    try:
        stream = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
        return _PICKLED, stream, [b.raw() for b in buffers]
    except Exception:  # a lambda, a class of the main module: cloudpickle, in the stream
        return _PICKLED, dumps(value), []


def _layout(stream: bytes, buffers: list[memoryview]) -> tuple[list[tuple[int, int]], int]:
    regions, offset = [], _HEAD.size + _MAC + _REGION.size * (1 + len(buffers))
    for n in [len(stream)] + [b.nbytes for b in buffers]:
        offset = -(-offset // _ALIGN) * _ALIGN
        regions.append((offset, n))
        offset += n
    return regions, max(offset, 1)


def _write(mm: mmap.mmap, key: bytes, version: int, kind: int, stream: bytes,
           buffers: list[memoryview], regions: list[tuple[int, int]]) -> None:
    _HEAD.pack_into(mm, 0, _MAGIC, version, kind, len(regions))
    table = _HEAD.size + _MAC
    for i, (offset, n) in enumerate(regions):
        _REGION.pack_into(mm, table + _REGION.size * i, offset, n)
    for (offset, n), data in zip(regions, [memoryview(stream)] + buffers):
        mm[offset:offset + n] = data
    view = memoryview(mm)
    try:
        mm[_HEAD.size:table] = mac(key, *_mac_parts(view, len(regions), stream))
    finally:
        view.release()


def _mac_parts(view: memoryview, count: int, stream: bytes | memoryview) -> tuple[bytes | memoryview, ...]:
    """What a segment's MAC covers: its header, its region table and its pickle stream."""
    # The buffers (numpy arrays, raw bytes) are left out: hashing them would cost a pass over
    # the whole value for each version and reader, and they are never unpickled: the stream,
    # which is authenticated, says what they are, and they are only ever read as data.
    table = _HEAD.size + _MAC
    return _SEGMENT_LABEL, view[:_HEAD.size], view[table:table + _REGION.size * count], stream


def _damaged(why: str) -> FiberError:
    return FiberError(f"a broadcast segment is not one this run wrote ({why}); nothing of it was "
                      "used. Every process of a run must use the same version of Fiber; if they do, "
                      "another program wrote it: check who can write to this host's /dev/shm")


def _decode(mm: mmap.mmap, key: bytes) -> tuple[int, Any]:
    """The version and value held in a segment; buffers are read-only views of ``mm``.

    Nothing is unpickled unless the segment's MAC shows that a holder of ``key`` wrote it.
    """
    view = memoryview(mm).toreadonly()
    if len(view) < _HEAD.size + _MAC:
        raise _damaged("too short")
    magic, version, kind, count = _HEAD.unpack_from(view, 0)
    table = _HEAD.size + _MAC
    if magic != _MAGIC or count < 1 or table + _REGION.size * count > len(view):
        raise _damaged("bad header")
    parts = []
    for i in range(count):
        offset, n = _REGION.unpack_from(view, table + _REGION.size * i)
        if offset + n > len(view):
            raise _damaged("a region lies outside it")
        parts.append(view[offset:offset + n])
    if not mac_matches(view[_HEAD.size:table], key, *_mac_parts(view, count, parts[0])):
        raise _damaged("its MAC does not match the run's key")
    if kind == _RAW:
        fmt, shape = pickle.loads(parts[0])
        return version, parts[1].cast(fmt, shape)
    return version, pickle.loads(parts[0], buffers=parts[1:])


# -- a host's directory of copies ------------------------------------------------------------


def store_name(key: bytes, run_id: str, job_host: str = "") -> str:
    """The name in ``/dev/shm`` of a run's directory of copies on one machine.

    ``fiber-bc-<run>-<tag>``, the tag a MAC with the run's key of the run and the machine:
    other users of the host can learn the run id, but not compute the name, so they cannot
    make the directory before the run does.
    """
    tag = mac(key, _DIR_LABEL, run_id.encode(), b"\0", job_host.encode()).hex()[:32]
    return f"fiber-bc-{run_id}-{tag}"


def _fresh(prefix: str) -> str:
    """A new name for a file of this process in a directory of copies: never a predictable one."""
    return f"{prefix}.{os.urandom(8).hex()}"


class _Store:
    """This process's use of its host's directory of segments (one per run and machine).

    The directory is made with mode 0700 and used only if it is this user's and closed to
    others; every file in it is opened without following links and checked as this
    user's, and made with ``O_EXCL`` under a random name (:mod:`fiber_core.base.owned`).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._dir = -1
        self._users = -1

    @property
    def joined(self) -> bool:
        """Whether this process uses the directory (:meth:`join` succeeded)."""
        return self._users >= 0

    def join(self) -> bool:
        """Become a user of the directory (created if need be); False if it cannot be used."""
        if self._users >= 0:
            return True
        for _ in range(10):
            try:
                dfd = owned.private_dir(self.path)
            except ForeignObjectError as e:
                _say_foreign(self.path, e)
                return False
            except OSError as e:
                log.debug("fiber: no shared directory for broadcast values at %s: %s", self.path, e)
                return False
            try:
                fd = owned.open_file(".users", os.O_RDONLY | os.O_CREAT, dfd, f"{self.path}/.users")
            except OSError as e:
                os.close(dfd)
                if isinstance(e, ForeignObjectError):
                    _say_foreign(self.path, e)
                    return False
                continue  # the last user of another process removed it meanwhile
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:  # the last user of another process may have removed it meanwhile
                same = os.stat(os.path.join(self.path, ".users"), follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except OSError:
                same = False
            if same:
                self._dir, self._users = dfd, fd
                track_shared_dir(self.path)
                return True
            os.close(fd)
            os.close(dfd)
        return False

    def _open(self, name: str, flags: int) -> int:
        return owned.open_file(name, flags, self._dir, f"{self.path}/{name}")

    def open(self, bid: str, version: int) -> mmap.mmap | None:
        """The mapping of a whole version here, or None if this host has none."""
        try:
            fd = self._open(f"{bid}-{version}", os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            return mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def create(self, bid: str, version: int, size: int, fetched: bool = True) -> tuple[str, mmap.mmap]:
        """A new, unnamed-yet segment: its temporary name and a writable mapping.

        A fetched one is written under :meth:`fetching`, so one found by the next
        fetcher was left by a fetcher that died; the publisher's is its own business.
        ``OSError`` (ENOSPC) when ``/dev/shm`` has no room for it: the space is
        reserved up front, so a full ``/dev/shm`` is an error here, not a SIGBUS later.
        """
        part = _fresh(f"{bid}-{version}.{'part' if fetched else 'new'}")
        fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL | owned.NOFOLLOW, 0o600, dir_fd=self._dir)
        try:
            os.posix_fallocate(fd, 0, size)
            return part, mmap.mmap(fd, size)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(part, dir_fd=self._dir)
            raise
        finally:
            os.close(fd)

    def publish(self, part: str, bid: str, version: int) -> None:
        """Give a whole segment its name: from now on readers here map it."""
        os.rename(part, f"{bid}-{version}", src_dir_fd=self._dir, dst_dir_fd=self._dir)

    def discard(self, part: str) -> None:
        """Remove a segment that :meth:`create` made and that will not be published."""
        with contextlib.suppress(OSError):
            os.unlink(part, dir_fd=self._dir)

    @contextlib.contextmanager
    def fetching(self, bid: str) -> Iterator[None]:
        """Hold the right to fetch ``bid`` for this host; left half-written parts are removed."""
        fd = self._open(f"{bid}.lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # a fetcher that dies lets go with its death
            for name in os.listdir(self._dir):
                if name.startswith(f"{bid}-") and ".part." in name:
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=self._dir)
            yield
        finally:
            os.close(fd)

    def drop(self, bid: str, below: int | None = None) -> None:
        """Remove the segments of ``bid`` older than ``below`` (all of them if None)."""
        with contextlib.suppress(OSError):
            for name in os.listdir(self._dir):
                head, _, tail = name.rpartition("-")
                if head == bid and tail.isdigit() and (below is None or int(tail) < below):
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=self._dir)
            if below is None:
                with contextlib.suppress(OSError):
                    os.unlink(f"{bid}.current", dir_fd=self._dir)

    def current(self, bid: str) -> int | None:
        """The publisher's current version, if the publisher shares this directory."""
        try:
            fd = self._open(f"{bid}.current", os.O_RDONLY)
        except OSError:
            return None
        try:
            return int(os.read(fd, 32) or b"0") or None
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)

    def set_current(self, bid: str, version: int) -> None:
        tmp = _fresh(f"{bid}.current")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | owned.NOFOLLOW, 0o600, dir_fd=self._dir)
        try:
            os.write(fd, b"%d" % version)
        finally:
            os.close(fd)
        os.rename(tmp, f"{bid}.current", src_dir_fd=self._dir, dst_dir_fd=self._dir)


_store: _Store | None = None
_store_key: tuple[str, str] | None = None
_store_lock = threading.Lock()
_said_private = False
_said_foreign: set[str] = set()


def _host_store() -> _Store | None:
    """This process's host directory, joined; None where ``/dev/shm`` cannot be used."""
    global _store, _store_key
    rt = runtime()
    run_id = rt.run_id
    job_host = os.environ.get(ENV_JOB_HOST, "")
    with _store_lock:
        if _store_key != (run_id, job_host):
            _store = _Store(os.path.join(SHM_ROOT, store_name(rt.authkey, run_id, job_host)))
            _store_key = (run_id, job_host)
        assert _store is not None
        return _store if _store.join() else None


def _say_foreign(path: str, error: ForeignObjectError) -> None:
    if path not in _said_foreign:
        _said_foreign.add(path)
        log.warning("fiber: %s; this process keeps broadcast values in its own memory instead. "
                    "Another user may have made it: remove it, or make sure it is this user's "
                    "with mode 0700", error)


def _say_private(why: str) -> None:
    global _said_private
    if not _said_private:
        _said_private = True
        log.info("fiber: this process keeps broadcast values in its own memory (%s)", why)


# -- the handle ----------------------------------------------------------------------------


class _Copy:
    """A version held by its publisher: the mapping it serves readers from."""

    __slots__ = ("version", "mm", "size")

    def __init__(self, version: int, mm: mmap.mmap, size: int) -> None:
        self.version, self.mm, self.size = version, mm, size


class Broadcast:
    """A published value: ``.value`` is its newest version in any process.

    Made by :func:`broadcast`. In the process that made it, :meth:`publish` makes a
    new version and :meth:`close` drops it; elsewhere those raise. Keep the handle
    referenced in the publisher while others read it: dropping it there closes it.
    """

    def __init__(self, value: Any) -> None:
        self.fiber_ref: Ref | None = None
        _route(runtime().hub)
        self._setup(ref_for_pickle(self), publisher=True)
        weakref.finalize(self, _forget_published, self._bid)
        self.publish(value)

    def _setup(self, ref: Ref, publisher: bool) -> None:
        """The state of a publisher or, rebuilt from a pickle, of a reader."""
        self.fiber_ref = ref
        self._bid = f"{ref.token}-{ref.oid}"
        self._lock = threading.Lock()
        self._publisher = publisher
        self._closed = False
        self._value: Any = None
        self._version = 0
        self._copy: _Copy | None = None
        self.shared = True
        """In a reader: whether its value maps this host's shared copy."""
        self.fetches = 0
        """In the publisher: how many times a whole version was sent to a host."""

    @property
    def _ref(self) -> Ref:
        ref = self.fiber_ref
        assert ref is not None
        return ref

    # -- the publisher's side --

    def publish(self, value: Any) -> int:
        """Make ``value`` the next version; returns its number (1, 2, ...).

        The value is copied once, into this host's shared memory (or this process's
        memory if ``/dev/shm`` has no room); later changes to ``value`` in place are not
        seen by readers: publish again.
        """
        self._check_publisher("publish")
        kind, stream, buffers = _encode(value)
        regions, size = _layout(stream, buffers)
        with self._lock:
            if self._closed:
                raise FiberError("this broadcast was closed: make a new one with fiber_core.broadcast()")
            version = self._version + 1
            store = _host_store()
            mm, part = None, None
            if store is not None:
                try:
                    part, mm = store.create(self._bid, version, size, fetched=False)
                except OSError as e:
                    _say_private(f"{SHM_ROOT}: {e}")
            if mm is None:
                mm = mmap.mmap(-1, size)
            _write(mm, runtime().authkey, version, kind, stream, buffers, regions)
            del stream, buffers
            if store is not None and part is not None:
                store.publish(part, self._bid, version)
                store.set_current(self._bid, version)
                store.drop(self._bid, below=version)
            self._copy = _Copy(version, mm, size)
            self._version, self._value = version, value
            return version

    def close(self) -> None:
        """Drop every version: readers' next reads raise. Idempotent."""
        self._check_publisher("close")
        with self._lock:
            self._closed, self._copy, self._value = True, None, None
        _forget_published(self._bid)

    def __enter__(self) -> Broadcast:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._publisher:
            self.close()

    def _check_publisher(self, what: str) -> None:
        if not self._publisher:
            raise FiberError(f"{what}() is for the process that made this broadcast; "
                             "here, read .value (the newest version)")

    def _newest(self) -> _Copy:
        with self._lock:
            if self._closed or self._copy is None:
                raise FiberError("this broadcast was closed by the process that published it")
            return self._copy

    def send_newest(self, conn: Connection, sock: Any) -> None:
        """Send a reader the newest version: its header over ``conn``, its bytes over
        ``sock`` (the same connection's socket), or why there is none."""
        try:
            copy = self._newest()
        except FiberError as e:
            conn.send_bytes(b"N" + str(e).encode())
            return
        conn.send_bytes(b"Y" + _ANSWER.pack(copy.version, copy.size))
        view = memoryview(copy.mm)
        try:
            for offset in range(0, copy.size, _CHUNK):
                sock.sendall(view[offset:offset + _CHUNK])
        finally:
            view.release()
        with self._lock:
            self.fetches += 1

    @classmethod
    def rebuild(cls, ref: Ref) -> Broadcast:
        """This process's reader of the broadcast ``ref`` names."""
        obj = known(ref)
        if obj is not None:
            return obj  # type: ignore[no-any-return]
        self = cls.__new__(cls)
        self._setup(ref, publisher=False)
        return remember(ref, self)  # type: ignore[no-any-return]

    def serve_call(self, served: Served, op: str, args: tuple) -> Any:
        if op == "version":
            return self._newest().version
        raise FiberError(f"a broadcast serves no operation {op!r}")

    def serve_lost(self, served: Served) -> Lost | None:
        return None

    # -- everyone's side --

    @property
    def value(self) -> Any:
        """The newest version's value (in a reader: fetched or mapped on first read of it)."""
        if self._publisher:
            with self._lock:
                if self._closed:
                    raise FiberError("this broadcast was closed: its value is gone")
                return self._value
        with self._lock:
            version = self._current()
            if version != self._version:
                self._version, self._value = self._load(version)
            return self._value

    @property
    def version(self) -> int:
        """The version this process holds: its last read's (the publisher's newest)."""
        return self._version

    def __repr__(self) -> str:
        role = "publisher" if self._publisher else "reader"
        return f"<fiber_core.Broadcast {self._bid} version={self._version} ({role})>"

    def __reduce__(self) -> tuple:
        return _rebuild, (ref_for_pickle(self),)

    # -- the reader's side --

    def _current(self) -> int:
        store = _host_store()
        if store is not None:
            version = store.current(self._bid)
            if version is not None:
                return version
        try:
            return int(Remote(self._ref, "broadcast").call("version"))
        except FiberError:
            if store is not None:
                store.drop(self._bid)
            raise

    def _load(self, version: int) -> tuple[int, Any]:
        store = _host_store()
        if store is None:
            _say_private(f"{SHM_ROOT} cannot be used here")
            return self._fetch_private()
        mm = store.open(self._bid, version)
        if mm is None:
            with store.fetching(self._bid):
                mm = store.open(self._bid, version)  # another reader here got it meanwhile
                if mm is None:
                    try:
                        version = self._fetch_to_store(store)
                    except _NoRoom as e:
                        _say_private(f"{SHM_ROOT}: {e}")
                        return self._fetch_private()
                    mm = store.open(self._bid, version)
                    assert mm is not None
        self.shared = True
        return _decode(mm, runtime().authkey)

    def _fetch(self, target: Any) -> int:
        """Receive the newest version into ``target(version, size)``'s mapping."""
        sock = dial(self._ref.addresses, runtime().authkey, TARGET)
        conn = Connection(sock)
        try:
            conn.send_bytes(_FETCH.pack(self._ref.oid))
            answer = conn.recv_bytes()
            if answer[:1] != b"Y":
                raise FiberError(bytes(answer[1:]).decode("utf-8", "replace"))
            version, size = _ANSWER.unpack(answer[1:])
            mm = target(version, size)
            view, got = memoryview(mm), 0
            try:
                while got < size:
                    n = sock.recv_into(view[got:got + _CHUNK])
                    if n == 0:
                        raise FiberError("the publisher of a broadcast went away while sending it")
                    got += n
            finally:
                view.release()
            return version
        finally:
            conn.close()

    def _fetch_to_store(self, store: _Store) -> int:
        made: list[tuple[str, mmap.mmap]] = []

        def target(version: int, size: int) -> mmap.mmap:
            try:
                made.append(store.create(self._bid, version, size))
            except OSError as e:
                raise _NoRoom(str(e)) from e
            return made[-1][1]

        try:
            version = self._fetch(target)
        except BaseException:
            for part, mm in made:
                mm.close()
                store.discard(part)
            raise
        part, mm = made[0]
        mm.close()
        store.publish(part, self._bid, version)
        store.drop(self._bid, below=version)
        return version

    def _fetch_private(self) -> tuple[int, Any]:
        held: list[mmap.mmap] = []

        def target(version: int, size: int) -> mmap.mmap:
            held.append(mmap.mmap(-1, size))
            return held[0]

        self._fetch(target)
        self.shared = False
        return _decode(held[0], runtime().authkey)


class _NoRoom(Exception):
    """This host's ``/dev/shm`` has no room for a version."""


def _rebuild(ref: Ref) -> Broadcast:
    return Broadcast.rebuild(ref)


def _forget_published(bid: str) -> None:
    """The publisher dropped or closed a broadcast: remove its segments on this host."""
    if _store is not None and _store.joined:
        _store.drop(bid)


def broadcast(value: Any) -> Broadcast:
    """Publish ``value`` to every process of the run; returns its :class:`Broadcast` handle."""
    return Broadcast(value)


# -- sending versions ------------------------------------------------------------------------


_routed: Hub | None = None
_routing = threading.Lock()


def _route(hub: Hub) -> None:
    global _routed
    with _routing:
        if _routed is not hub:
            hub.register(TARGET, _serve_fetch)
            _routed = hub


def _serve_fetch(target: str, sock: Any) -> None:
    """Send whole versions to a reader, on a connection of its own, until it hangs up."""
    conn = Connection(sock)
    try:
        while True:
            (oid,) = _FETCH.unpack(conn.recv_bytes())
            obj = known(Ref(TOKEN, HOST, "", oid))
            if not isinstance(obj, Broadcast):
                conn.send_bytes(b"N" + b"this broadcast no longer exists in the process that "
                                b"published it: keep the handle referenced there while others "
                                b"read it")
                continue
            obj.send_newest(conn, sock)
    except (EOFError, OSError) as e:
        if not isinstance(e, EOFError) and e.errno not in (errno.EPIPE, errno.ECONNRESET, None):
            log.debug("fiber: sending a broadcast version failed: %s", e)
    finally:
        conn.close()
