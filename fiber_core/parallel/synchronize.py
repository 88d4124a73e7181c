"""``Lock``, ``RLock``, ``Semaphore``, ``BoundedSemaphore``, ``Condition``, ``Event``, ``Barrier``.

The semantics of :mod:`multiprocessing.synchronize`, built as the stdlib builds
them under spawn (named POSIX semaphores: the stdlib's own
``_multiprocessing.SemLock``), and usable by the jobs of every backend. A job
on the creator's host that can open the semaphores attaches to them and runs
at the stdlib's speed; any other job has the creator serve each operation (a
round trip): see :mod:`fiber_core.parallel.sharing`. Unlike the stdlib's, these
objects may be pickled whenever they are sent to a job: as a Process argument,
a Pool task or initializer argument, or through a Queue.

Lost holders, by path:

* served (the job is on another host, or in a container): the creator holds
  the lock for the job, in the thread that serves the job's thread. When that
  connection ends (the job's thread or process ended, it was killed, its host
  was lost and ``peer_timeout`` passed) the creator releases, with a warning,
  what the job still held: a ``Lock`` or ``RLock`` it owns (every level of an
  RLock), a ``Condition``'s lock, the units of a ``BoundedSemaphore`` it
  acquired and did not release. A plain ``Semaphore`` is not given back: its
  acquisitions may be consumed signals, not holds. An ``acquire`` the job was
  blocked in is abandoned within 0.2 s (a unit it got meanwhile goes back), and a
  wakeup that a ``Condition`` gave to a waiter that went away passes to another
  waiter. (A creator's thread that waited on an Event or Barrier for a job that
  went away ends when the event is set or the barrier trips.)
* attached (the same host, the OS semaphore itself): exactly as with
  multiprocessing. A process killed while it holds a lock leaves it taken; a
  ``with`` block or ``finally`` that runs releases it as usual. Waiters with a
  timeout get ``False``, others wait; a ``Lock`` (not an ``RLock``) may be
  released by any process, as in multiprocessing.

The queries ``_is_mine``, ``_count`` and ``_get_value`` of ``_multiprocessing.SemLock``
are underscored in the stdlib, which calls them from its own reprs and tests; they are
read in one place, :func:`_ownership`.
"""

from __future__ import annotations

import _multiprocessing
import errno
import multiprocessing.synchronize as _mp
import sys
import threading
from collections.abc import Callable

from fiber_core.base.errors import FiberError, ForeignObjectError
from fiber_core.parallel.sharing import (
    Lost,
    PeerGone,
    Ref,
    Remote,
    Segment,
    Served,
    attach_semlock,
    create_semlock,
    known,
    may_attach,
    ref_for_pickle,
    remember,
    serving,
)
from fiber_core.processes.process import current_process

TYPE_CHECKING = False  # typing's own, without importing typing: the template preloads this module
if TYPE_CHECKING:
    from typing import Any

RECURSIVE_MUTEX, SEMAPHORE = 0, 1
SEM_VALUE_MAX = _multiprocessing.SemLock.SEM_VALUE_MAX

_QUERIES = frozenset({"_count", "_is_mine", "_get_value", "_is_zero"})


def _bad_op(obj: Any, op: str) -> FiberError:
    return FiberError(f"{type(obj).__name__} has no operation {op!r} that its creator serves")


def _me() -> str:
    """The owner's name in a lock's repr, as the stdlib writes it."""
    name = current_process().name
    thread = threading.current_thread().name
    return name if thread == "MainThread" else f"{name}|{thread}"


class _RemoteSemLock:
    """The interface of ``_multiprocessing.SemLock`` for a lock that its creator serves."""

    handle = None

    def __init__(self, ref: Ref, kind: int, maxvalue: int, name: str | None, what: str) -> None:
        self._remote = Remote(ref, what)
        self.kind = kind
        self.maxvalue = maxvalue
        self.name = name

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        return self._remote.acquire(block, timeout)

    def release(self) -> None:
        self._remote.release()

    def __enter__(self) -> bool:
        return self._remote.acquire()

    def __exit__(self, *args: object) -> None:
        self._remote.release()

    def _count(self) -> int:
        return self._remote.call("_count")

    def _is_mine(self) -> bool:
        return self._remote.call("_is_mine")

    def _get_value(self) -> int:
        return self._remote.call("_get_value")

    def _is_zero(self) -> bool:
        return self._remote.call("_is_zero")

    def _after_fork(self) -> None:
        pass


def _ownership(sl: Any) -> tuple[bool, int, int]:
    """Whether this thread holds semaphore ``sl``, its recursion count, and its value."""
    return sl._is_mine(), sl._count(), sl._get_value()  # noqa: SLF001 - the stdlib SemLock's state, read only this way (see the module note)


def _check_value(value: int) -> None:
    if isinstance(value, int) and value < 0:
        raise OSError(errno.EINVAL, f"a semaphore's value must be >= 0, not {value}")


class SemLock(_mp.SemLock):
    """What every lock and semaphore shares: a named semaphore, attached or served."""

    fiber_ref: Ref | None = None

    def __init__(self, kind: int, value: int, maxvalue: int, *, ctx: Any = None) -> None:
        self._semlock = create_semlock(self, kind, value, maxvalue)
        self._make_methods()

    def _make_methods(self) -> None:
        # The semaphore's own methods, bound as the stdlib binds them: nothing in between.
        self.acquire = self._semlock.acquire  # type: ignore[method-assign]
        self.release = self._semlock.release  # type: ignore[method-assign]

    def __reduce__(self) -> tuple:
        sl = self._semlock
        return _rebuild_semlock, (type(self), ref_for_pickle(self), sl.kind, sl.maxvalue, sl.name)

    # -- the creator serving a job's thread (see fiber_core.parallel.sharing.Served) ----

    def serve_acquire(self, served: Served, block: bool, timeout: float | None) -> bool:
        sl = self._semlock
        if not block:
            got = sl.acquire(False)
        else:
            got = served.blocking(lambda t: sl.acquire(True, t), timeout)
        if got:
            if served.peer_gone():  # it will never know: as if it had not asked
                sl.release()
                raise PeerGone
            served.count(self, 1)
        return got

    def serve_release(self, served: Served) -> None:
        self._semlock.release()
        served.count(self, -1)

    def serve_call(self, served: Served, op: str, args: tuple) -> Any:
        if op in _QUERIES:
            return getattr(self._semlock, op)()
        raise _bad_op(self, op)

    def serve_lost(self, served: Served) -> Lost | None:
        """A Lock or RLock: every level that the session's thread owns."""
        sl = self._semlock
        mine, levels, _ = _ownership(sl)
        if not mine:
            return None

        def release() -> None:
            for _ in range(levels):
                try:
                    sl.release()
                except (ValueError, AssertionError):  # released elsewhere meanwhile
                    return

        name = type(self).__name__
        article = "an" if name[0] in "AEIOR" else "a"  # an RLock
        return f"{article} {name}" + (f" ({levels} levels)" if levels > 1 else ""), release

    @classmethod
    def rebuild(cls, ref: Ref, kind: int, maxvalue: int, name: str) -> SemLock:
        """This process's copy of the lock ``ref`` names: attached if it can be, else served."""
        obj = known(ref)
        if obj is not None:
            return obj
        semlock: Any = None
        if may_attach(ref):
            try:
                semlock = attach_semlock(kind, maxvalue, name, ref.uid)
            except ForeignObjectError:
                raise
            except OSError:  # not visible here (another IPC namespace, another user)
                pass
        if semlock is None:
            semlock = _RemoteSemLock(ref, kind, maxvalue, name, cls.__name__)
        return remember(ref, cls.from_semlock(semlock))

    @classmethod
    def from_semlock(cls, semlock: Any) -> SemLock:
        """A lock of this class whose operations are those of ``semlock``: a
        ``_multiprocessing.SemLock`` or a served one's stand-in."""
        self = cls.__new__(cls)
        self._semlock = semlock
        self._make_methods()
        return self


def _rebuild_semlock(cls: type[SemLock], ref: Ref, kind: int, maxvalue: int, name: str) -> SemLock:
    return cls.rebuild(ref, kind, maxvalue, name)


class Semaphore(SemLock, _mp.Semaphore):
    """A semaphore with ``get_value()``; the same across processes."""

    def __init__(self, value: int = 1, *, ctx: Any = None) -> None:
        _check_value(value)
        SemLock.__init__(self, SEMAPHORE, value, SEM_VALUE_MAX)

    def serve_lost(self, served: Served) -> Lost | None:
        return None  # an acquisition may be a consumed signal, not a hold


class BoundedSemaphore(Semaphore, _mp.BoundedSemaphore):
    """A semaphore that cannot be released above its initial value (``ValueError``)."""

    def __init__(self, value: int = 1, *, ctx: Any = None) -> None:
        _check_value(value)
        SemLock.__init__(self, SEMAPHORE, value, value)

    def serve_lost(self, served: Served) -> Lost | None:
        held = served.held.pop(id(self), 0)
        if not held:
            return None

        def release() -> None:
            for _ in range(held):
                try:
                    self._semlock.release()
                except ValueError:  # released elsewhere meanwhile
                    return

        return f"{held} unit(s) of a BoundedSemaphore", release


class Lock(SemLock, _mp.Lock):
    """A non-recursive lock; any process may release it, as in multiprocessing."""

    def __init__(self, *, ctx: Any = None) -> None:
        SemLock.__init__(self, SEMAPHORE, 1, 1)

    def __repr__(self) -> str:
        try:
            mine, count, value = _ownership(self._semlock)
            if mine:
                name = _me()
            elif value == 1:
                name = "None"
            elif count > 0:
                name = "SomeOtherThread"
            else:
                name = "SomeOtherProcess"
        except Exception:
            name = "unknown"
        return f"<{type(self).__name__}(owner={name})>"


class RLock(SemLock, _mp.RLock):
    """A recursive lock: only the thread that holds it may release it."""

    def __init__(self, *, ctx: Any = None) -> None:
        SemLock.__init__(self, RECURSIVE_MUTEX, 1, 1)

    def __repr__(self) -> str:
        count: Any
        try:
            mine, levels, value = _ownership(self._semlock)
            if mine:
                name, count = _me(), levels
            elif value == 1:
                name, count = "None", 0
            elif levels > 0:
                name, count = "SomeOtherThread", "nonzero"
            else:
                name, count = "SomeOtherProcess", "nonzero"
        except Exception:
            name, count = "unknown", "unknown"
        return f"<{type(self).__name__}({name}, {count})>"


def _served_lock_view(ref: Ref, lock: Any) -> SemLock:
    """A Lock or RLock whose operations go to the object ``ref`` (a served Condition's lock)."""
    kind = getattr(getattr(lock, "_semlock", None), "kind", RECURSIVE_MUTEX)
    cls: type[SemLock] = RLock if kind == RECURSIVE_MUTEX else Lock
    return cls.from_semlock(_RemoteSemLock(ref, kind, 1, None, "Condition"))


def _is_served(obj: Any) -> bool:
    return isinstance(getattr(obj, "_semlock", None), _RemoteSemLock) or \
        getattr(obj, "_remote", None) is not None


class Condition(_mp.Condition):
    """A condition variable over a Lock or RLock (by default a new RLock)."""

    fiber_ref: Ref | None = None
    _remote: Remote | None = None
    _parts: tuple | None = None  # a served copy's: what it was rebuilt from, to send it on

    def __init__(self, lock: Any = None, *, ctx: Any = None) -> None:
        self._lock = lock or RLock()
        self._sleeping_count = Semaphore(0)
        self._woken_count = Semaphore(0)
        self._wait_semaphore = Semaphore(0)
        self._make_methods()

    def _make_methods(self) -> None:
        self.acquire = self._lock.acquire  # type: ignore[method-assign]
        self.release = self._lock.release  # type: ignore[method-assign]

    def __reduce__(self) -> tuple:
        parts = self._parts or (
            self._lock, self._sleeping_count, self._woken_count, self._wait_semaphore)
        return _rebuild_condition, (ref_for_pickle(self), parts)

    def __repr__(self) -> str:
        if self._remote is None:
            return super().__repr__()
        try:
            waiters = self._remote.call("_waiters")
        except Exception:
            waiters = "unknown"
        return f"<{type(self).__name__}({self._lock}, {waiters})>"

    # -- served ------------------------------------------------------------------------

    def serve_acquire(self, served: Served, block: bool, timeout: float | None) -> bool:
        return self._lock.serve_acquire(served, block, timeout)

    def serve_release(self, served: Served) -> None:
        self._lock.serve_release(served)

    def serve_call(self, served: Served, op: str, args: tuple) -> Any:
        if op == "wait":
            woken = self.wait(*args)
            if woken and served.peer_gone():
                self.notify(1)  # the waiter went away: its wakeup goes to another one
            return woken
        if op == "notify":
            return self.notify(*args)
        if op == "_waiters":
            return self._sleeping_count.get_value() - self._woken_count.get_value()
        if op in _QUERIES:
            return self._lock.serve_call(served, op, args)
        raise _bad_op(self, op)

    def serve_lost(self, served: Served) -> Lost | None:
        lost = self._lock.serve_lost(served)
        return None if lost is None else ("the lock of a Condition", lost[1])

    @classmethod
    def rebuild(cls, ref: Ref, parts: tuple) -> Condition:
        """This process's copy of the Condition ``ref`` names, from its lock and semaphores."""
        obj = known(ref)
        if obj is not None:
            return obj
        self = cls.__new__(cls)
        lock, sleeping, woken, wait_semaphore = parts
        if any(_is_served(s) for s in parts[1:]):
            remote = self._remote = Remote(ref, "Condition")
            self._lock = _served_lock_view(ref, lock)
            self._parts = parts

            # Only a served copy gets these: an attached one runs the stdlib's methods as they are.
            def wait(timeout: float | None = None) -> bool:
                return remote.call("wait", timeout)

            def notify(n: int = 1) -> None:
                remote.call("notify", n)

            def notify_all() -> None:
                remote.call("notify", sys.maxsize)

            vars(self).update(wait=wait, notify=notify, notify_all=notify_all)
        else:
            self._lock, self._sleeping_count, self._woken_count, self._wait_semaphore = parts
        self._make_methods()
        return remember(ref, self)


def _rebuild_condition(ref: Ref, parts: tuple) -> Condition:
    return Condition.rebuild(ref, parts)


class Event(_mp.Event):
    """An event flag with ``set``, ``clear``, ``is_set`` and ``wait``."""

    fiber_ref: Ref | None = None
    _remote: Remote | None = None

    def __init__(self, *, ctx: Any = None) -> None:
        self._cond = Condition(Lock())
        self._flag = Semaphore(0)

    def __reduce__(self) -> tuple:
        return _rebuild_event, (ref_for_pickle(self), self._cond, self._flag)

    def serve_call(self, served: Served, op: str, args: tuple) -> Any:
        if op in ("is_set", "set", "clear", "wait"):
            return getattr(self, op)(*args)
        raise _bad_op(self, op)

    def serve_lost(self, served: Served) -> Lost | None:
        return None  # its lock is held only inside one served operation

    @classmethod
    def rebuild(cls, ref: Ref, cond: Condition, flag: Semaphore) -> Event:
        """This process's copy of the Event ``ref`` names, from its Condition and flag."""
        obj = known(ref)
        if obj is not None:
            return obj
        self = cls.__new__(cls)
        self._cond, self._flag = cond, flag
        if _is_served(cond) or _is_served(flag):
            remote = self._remote = Remote(ref, "Event")

            def wait(timeout: float | None = None) -> bool:
                return remote.call("wait", timeout)

            vars(self).update(wait=wait, is_set=lambda: remote.call("is_set"),
                              set=lambda: remote.call("set"), clear=lambda: remote.call("clear"))
        return remember(ref, self)


def _rebuild_event(ref: Ref, cond: Condition, flag: Semaphore) -> Event:
    return Event.rebuild(ref, cond, flag)


class Barrier(_mp.Barrier):
    """A barrier for ``parties`` processes or threads, with ``action``, ``abort`` and ``reset``.

    Its state (two ints) is in a shared-memory segment and its waits use a
    :class:`Condition`, as in multiprocessing. The ``action`` runs in the
    process of the last party to arrive, whichever path that process uses.
    """

    fiber_ref: Ref | None = None
    _remote: Remote | None = None
    _break: Callable[[], None]  # threading.Barrier's

    def __init__(self, parties: int, action: Callable[[], Any] | None = None,
                 timeout: float | None = None, *, ctx: Any = None) -> None:
        if isinstance(parties, bool) or not isinstance(parties, int) or parties < 1:
            raise ValueError(f"a Barrier's parties must be an integer >= 1, not {parties!r}")
        self._setup(parties, action, timeout, Condition(), Segment.create(8))
        self._state = 0
        self._count = 0

    def _setup(self, parties: int, action: Callable[[], Any] | None, timeout: float | None,
               cond: Condition, segment: Segment | None) -> None:
        self._parties, self._action, self._timeout, self._cond = parties, action, timeout, cond
        self._segment = segment
        if segment is not None:
            self._segment_name = segment.name
            self._array = memoryview(segment.buf).cast("i")

    def __reduce__(self) -> tuple:
        return _rebuild_barrier, (ref_for_pickle(self), self._parties, self._action, self._timeout,
                                  self._cond, self._segment_name)

    def _release(self) -> None:
        # threading.Barrier's, except that a party served by this process (the creator)
        # runs the action in its own process.
        try:
            if self._action:
                served = serving()
                if served is not None:
                    served.run_action()
                else:
                    self._action()
            self._state = 1
            self._cond.notify_all()
        except BaseException:
            self._break()
            raise

    @property
    def n_waiting(self) -> int:
        if self._remote is not None:
            return self._remote.call("n_waiting")
        return self._count if self._state == 0 else 0

    @property
    def broken(self) -> bool:
        if self._remote is not None:
            return self._remote.call("broken")
        return self._state == -2

    def serve_call(self, served: Served, op: str, args: tuple) -> Any:
        if op in ("wait", "reset", "abort"):
            return getattr(self, op)(*args)
        if op in ("n_waiting", "broken"):
            return getattr(self, op)
        raise _bad_op(self, op)

    def serve_lost(self, served: Served) -> Lost | None:
        return None  # its lock is held only inside one served operation

    @classmethod
    def rebuild(cls, ref: Ref, parties: int, action: Callable[[], Any] | None,
                timeout: float | None, cond: Condition, segment_name: str) -> Barrier:
        """This process's copy of the Barrier ``ref`` names: its state attached if it can
        be, else served."""
        obj = known(ref)
        if obj is not None:
            return obj
        self = cls.__new__(cls)
        segment = None
        if may_attach(ref) and not _is_served(cond):
            try:
                segment = Segment.attach(segment_name, 8, ref.uid)
            except ForeignObjectError:
                raise
            except OSError:
                pass
        self._setup(parties, action, timeout, cond, segment)
        self._segment_name = segment_name
        if segment is None:
            remote = self._remote = Remote(ref, "Barrier")

            def wait(timeout: float | None = None) -> int:
                return remote.call("wait", timeout, action=action)

            vars(self).update(wait=wait, reset=lambda: remote.call("reset"),
                              abort=lambda: remote.call("abort"))
        return remember(ref, self)


def _rebuild_barrier(ref: Ref, parties: int, action: Callable[[], Any] | None,
                     timeout: float | None, cond: Condition, segment_name: str) -> Barrier:
    return Barrier.rebuild(ref, parties, action, timeout, cond, segment_name)


__all__ = ["Barrier", "BoundedSemaphore", "Condition", "Event", "Lock", "RLock", "SemLock",
           "Semaphore"]
