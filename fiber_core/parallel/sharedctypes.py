"""``Value``, ``Array``, ``RawValue``, ``RawArray``: ctypes objects in shared memory, for every backend.

As :mod:`multiprocessing.sharedctypes`. Each object is a ctypes object (of its
type, or a subclass of it that knows how to travel) over a named POSIX
shared-memory segment of its creator's host. Sent to a job:

* on that host, where the job can open the segment, it maps it: real shared
  memory, so every write of any process is seen by all, and
  ``np.frombuffer(arr.get_obj())`` is a view of it, at the stdlib's speed;
* anywhere else (another host, a container with its own ``/dev/shm``), the
  creator serves it: ``arr[i]``, ``arr[a:b]``, ``.value`` and their assignments
  each cost a round trip, under the object's lock when it has one (the creator
  takes the lock for it, in one round trip). There is no memory here to view:
  ``get_obj()``, and buffer access to a raw one, raise :class:`SharedBufferError`.

The segment is removed when its creator drops the object or exits; a job that
mapped it never removes it (see :mod:`fiber_core.parallel.sharing`).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing.sharedctypes as _mp
import sys
import weakref
from typing import Any

from fiber_core.base.errors import FiberError, ForeignObjectError
from fiber_core.parallel.sharing import (
    Lost,
    Ref,
    Remote,
    Segment,
    Served,
    known,
    may_attach,
    ref_for_pickle,
    remember,
)
from fiber_core.parallel.synchronize import RLock

typecode_to_type: dict[str, Any] = dict(vars(_mp)["typecode_to_type"])


class SharedBufferError(FiberError, BufferError):
    """Buffer access to a shared ctypes object whose memory is on another host.

    The object is served by its creator: element, slice and ``.value`` access
    work (each a round trip); a buffer view of its memory cannot.
    """


def _no_buffer(what: str, instead: str = "element and slice access (a[i], a[:], a[i] = x, "
              ".value), which go through the creator") -> SharedBufferError:
    return SharedBufferError(
        f"this shared {what} is served by its creator: its memory is not mapped in this "
        "process (it is on another host, or that host's /dev/shm is not visible here), so "
        f"there is no buffer to view with get_obj(), memoryview or np.frombuffer. Use {instead}, "
        "or run the jobs where they share the creator's memory (the local backend, or hosts "
        "that see its /dev/shm)")


# -- the shared objects -------------------------------------------------------------------


def _type_of(typecode_or_type: Any) -> Any:
    type_: Any = typecode_to_type.get(typecode_or_type, typecode_or_type) \
        if isinstance(typecode_or_type, str) else typecode_or_type
    try:
        ctypes.sizeof(type_)
    except TypeError:
        raise TypeError(f"bad typecode or type {typecode_or_type!r}: expected one of "
                        f"{' '.join(typecode_to_type)} or a ctypes type") from None
    return type_


_MAIN_MODULES = ("__main__", "__mp_main__")


def _describe(t: Any) -> tuple:
    """A picklable description of a ctypes type.

    Array types have no importable name; a Structure of the main module goes by name
    (cloudpickle cannot copy a ctypes type by value), found in the job's copy of it.
    """
    if issubclass(t, ctypes.Array):
        return ("array", _describe(t._type_), t._length_)
    if t.__module__ in _MAIN_MODULES:
        return ("main", t.__qualname__)
    return ("type", t)


def _undescribe(desc: tuple) -> Any:
    if desc[0] == "array":
        return _undescribe(desc[1]) * desc[2]
    if desc[0] == "main":
        for module in reversed(_MAIN_MODULES):  # a job imports the main module as __mp_main__
            found = getattr(sys.modules.get(module), desc[1], None)
            if isinstance(found, type):
                return found
        raise TypeError(f"the ctypes type {desc[1]!r} of the program's main module is not "
                        "defined here: define it at the top of the main module, or in a module "
                        "that every process imports")
    return desc[1]


# The base of c_int & co., which ctypes leaves underscored (the stdlib's sharedctypes uses it).
_SimpleCData = ctypes._SimpleCData  # noqa: SLF001 - ctypes names the base of its simple types only privately
_shared_types: dict[type, type] = {}
_make_property = vars(_mp)["make_property"]  # the stdlib's field accessors of wrappers


def _shared_type(base: type) -> Any:
    """The subclass of ``base`` whose instances in shared memory travel as such."""
    cls = _shared_types.get(base)
    if cls is None:
        ns: dict[str, Any] = {"__module__": __name__, "__qualname__": base.__name__,
                              "fiber_ref": None, "__reduce__": _reduce_shared,
                              "serve_call": _serve_ctype, "serve_lost": _nothing_held}
        if issubclass(base, _SimpleCData):
            ns["__repr__"] = _simple_repr
        cls = type(base)(base.__name__, (base,), ns)
        _shared_types[base] = cls
    return cls


def _base_of(t: type) -> type:
    return t.__bases__[0] if _shared_types.get(t.__bases__[0]) is t else t


def _simple_repr(self: Any) -> str:
    return f"{_base_of(type(self)).__name__}({self.value!r})"


def _reduce_shared(self: Any) -> tuple:
    segment: Segment = self.fiber_segment
    return _rebuild_ctype, (_describe(_base_of(type(self))), segment.name, segment.size,
                            ref_for_pickle(self))


def _rebuild_ctype(desc: tuple, name: str, size: int, ref: Ref) -> Any:
    obj = known(ref)
    if obj is not None:
        return obj
    type_ = _undescribe(desc)
    if may_attach(ref):
        try:
            segment = Segment.attach(name, size, ref.uid)
        except ForeignObjectError:
            raise
        except OSError:  # not visible here (another IPC namespace, another user)
            pass
        else:
            obj = _shared_type(type_).from_buffer(segment.buf)
            obj.fiber_segment = segment
    if obj is None:
        obj = ServedCtypes(ref, desc, name, size)
    return remember(ref, obj)


def _new_value(type_: type) -> Any:
    segment = Segment.create(ctypes.sizeof(type_))  # a new segment is zero-filled
    obj = _shared_type(type_).from_buffer(segment.buf)
    obj.fiber_segment = segment
    return obj


def RawValue(typecode_or_type: Any, *args: Any) -> Any:  # noqa: N802 - multiprocessing's name
    """A ctypes object in shared memory (no lock)."""
    obj = _new_value(_type_of(typecode_or_type))
    obj.__init__(*args)
    return obj


def RawArray(typecode_or_type: Any, size_or_initializer: Any) -> Any:  # noqa: N802
    """A ctypes array in shared memory (no lock): a length (zeros) or a sequence."""
    type_ = _type_of(typecode_or_type)
    if isinstance(size_or_initializer, int):
        return _new_value(type_ * size_or_initializer)
    result = _new_value(type_ * len(size_or_initializer))
    result.__init__(*size_or_initializer)
    return result


def _lock_for(lock: Any) -> Any:
    if lock in (True, None):
        return RLock()
    if not hasattr(lock, "acquire"):
        raise AttributeError(f"{lock!r} has no method 'acquire'")
    return lock


def Value(typecode_or_type: Any, *args: Any, lock: Any = True, ctx: Any = None) -> Any:  # noqa: N802
    """A synchronized ctypes object in shared memory; ``lock=False`` gives the raw object."""
    if lock is False:
        return RawValue(typecode_or_type, *args)
    lock = _lock_for(lock)
    return synchronized(RawValue(typecode_or_type, *args), lock)


def Array(typecode_or_type: Any, size_or_initializer: Any, *, lock: Any = True,  # noqa: N802
          ctx: Any = None) -> Any:
    """A synchronized ctypes array in shared memory; ``lock=False`` gives the raw array."""
    if lock is False:
        return RawArray(typecode_or_type, size_or_initializer)
    lock = _lock_for(lock)
    return synchronized(RawArray(typecode_or_type, size_or_initializer), lock)


def copy(obj: Any) -> Any:
    """A new shared object with the type and contents of ``obj``."""
    if isinstance(obj, ServedCtypes):
        data = obj.fiber_bytes()
        new = _new_value(obj.fiber_type)
        ctypes.memmove(ctypes.addressof(new), data, len(data))
        return new
    base = _base_of(type(obj))
    new = _new_value(base)
    ctypes.memmove(ctypes.addressof(new), ctypes.addressof(obj), ctypes.sizeof(base))
    return new


# -- the creator serving an object to a job elsewhere ---------------------------------------


def _names(obj: Any) -> frozenset[str]:
    return frozenset(("value", "raw", *(f[0] for f in getattr(type(obj), "_fields_", ()))))


def _check_key(obj: Any, key: Any) -> None:
    if isinstance(key, str) and key not in _names(obj):
        raise AttributeError(f"{type(obj).__name__!r} object has no attribute {key!r}")


def _serve_ctype(self: Any, served: Served, op: str, args: tuple) -> Any:
    if op in ("get", "set"):
        key, lock_oid = args[0], args[-1]
        _check_key(self, key)
        lock = served.obj(lock_oid) if lock_oid else contextlib.nullcontext()
        with lock:
            if op == "get":
                return getattr(self, key) if isinstance(key, str) else self[key]
            if isinstance(key, str):
                setattr(self, key, args[1])
            else:
                self[key] = args[1]
            return None
    if op == "bytes":
        return ctypes.string_at(ctypes.addressof(self), ctypes.sizeof(self))
    if op == "repr":
        return repr(self)
    raise FiberError(f"a shared {type(self).__name__} has no operation {op!r} that its creator serves")


def _nothing_held(self: Any, served: Served) -> None:
    return None


class ServedCtypes:
    """A shared ctypes object whose memory is on another host: its creator serves each access."""

    __slots__ = ("_remote", "_desc", "_name", "_size", "fiber_type", "_fields", "fiber_ref",
                 "__weakref__")

    def __init__(self, ref: Ref, desc: tuple, name: str, size: int) -> None:
        type_ = _undescribe(desc)
        init = object.__setattr__
        init(self, "_remote", Remote(ref, f"shared {type_.__name__}"))
        init(self, "_desc", desc)
        init(self, "_name", name)
        init(self, "_size", size)
        init(self, "fiber_type", type_)
        init(self, "_fields", frozenset(f[0] for f in getattr(type_, "_fields_", ())))
        init(self, "fiber_ref", ref)

    def __reduce__(self) -> tuple:
        return _rebuild_ctype, (self._desc, self._name, self._size, self.fiber_ref)

    # The ``fiber_`` names keep out of the way of the fields of the user's Structure.

    def fiber_get(self, key: Any, lock_oid: int = 0) -> Any:
        """An element, field or ``value``, read by the creator (under the lock ``lock_oid``
        names if not 0, a lock the same creator serves)."""
        return self._remote.call("get", key, lock_oid)

    def fiber_set(self, key: Any, value: Any, lock_oid: int = 0) -> None:
        """Write an element, field or ``value`` (as :meth:`fiber_get` reads one)."""
        self._remote.call("set", key, value, lock_oid)

    def fiber_bytes(self) -> bytes:
        """A copy of the object's memory."""
        return self._remote.call("bytes")

    def __len__(self) -> int:
        length = getattr(self.fiber_type, "_length_", None)
        if length is None:
            raise TypeError(f"object of type {self.fiber_type.__name__!r} has no len()")
        return length

    def __getitem__(self, key: Any) -> Any:
        return self.fiber_get(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.fiber_set(key, value)

    def __iter__(self) -> Any:
        return iter(self.fiber_get(slice(None)))

    @property
    def value(self) -> Any:
        return self.fiber_get("value")

    @value.setter
    def value(self, value: Any) -> None:
        self.fiber_set("value", value)

    @property
    def raw(self) -> Any:
        return self.fiber_get("raw")

    @raw.setter
    def raw(self, value: Any) -> None:
        self.fiber_set("raw", value)

    @property
    def _length_(self) -> int:
        return len(self)

    @property
    def _type_(self) -> Any:
        return getattr(self.fiber_type, "_type_", None)

    def __getattr__(self, name: str) -> Any:
        try:
            fields = object.__getattribute__(self, "_fields")
        except AttributeError:
            fields = frozenset()
        if name in fields:
            return self.fiber_get(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._fields:
            self.fiber_set(name, value)
        else:
            object.__setattr__(self, name, value)

    def __buffer__(self, flags: int) -> memoryview:  # Python 3.12+: memoryview(), np.frombuffer
        raise _no_buffer(self.fiber_type.__name__)

    @property
    def __array_interface__(self) -> dict:  # np.asarray, np.array
        raise _no_buffer(self.fiber_type.__name__)

    def __repr__(self) -> str:
        try:
            shown = self._remote.call("repr")
        except Exception:
            shown = f"<{self.fiber_type.__name__}>"
        return f"{shown} (served by its creator)"


class BufferWrapper:
    """A block of shared memory, as ``multiprocessing.heap.BufferWrapper``: ``create_memoryview()``.

    A process that cannot map it (another host) gets :class:`SharedBufferError` from
    ``create_memoryview()``: a block has no element access to serve.
    """

    fiber_ref: Ref | None = None

    def __init__(self, size: int) -> None:
        if not 0 <= size < sys.maxsize:
            raise ValueError(f"Size {size} out of bounds")
        self._segment: Segment | None = Segment.create(size)
        self._name, self._size = self._segment.name, size

    def create_memoryview(self) -> memoryview:
        if self._segment is None:
            raise _no_buffer("memory block", "an Array or Value (their elements are served)")
        return memoryview(self._segment.buf)[:self._size]

    def __reduce__(self) -> tuple:
        return _rebuild_buffer, (self._name, self._size, ref_for_pickle(self))

    def serve_call(self, served: Served, op: str, args: tuple) -> Any:
        raise FiberError("a shared memory block has no operation that its creator serves")

    def serve_lost(self, served: Served) -> Lost | None:
        return None

    @classmethod
    def rebuild(cls, name: str, size: int, ref: Ref) -> BufferWrapper:
        """This process's copy of the block ``ref`` names: mapped if it can be."""
        obj = known(ref)
        if obj is not None:
            return obj
        self = cls.__new__(cls)
        self._name, self._size, self._segment = name, size, None
        if may_attach(ref):
            try:
                self._segment = Segment.attach(name, size, ref.uid)
            except ForeignObjectError:
                raise
            except OSError:
                pass
        return remember(ref, self)


def _rebuild_buffer(name: str, size: int, ref: Ref) -> BufferWrapper:
    return BufferWrapper.rebuild(name, size, ref)


# -- synchronized wrappers ------------------------------------------------------------------


class _Reduce:
    """Pickled whenever it is sent (multiprocessing allows it only while spawning)."""

    _obj: Any
    _lock: Any

    def __reduce__(self) -> tuple:
        return synchronized, (self._obj, self._lock)


class SynchronizedBase(_Reduce, _mp.SynchronizedBase):
    pass


class Synchronized(_Reduce, _mp.Synchronized):
    pass


class SynchronizedArray(_Reduce, _mp.SynchronizedArray):
    pass


class SynchronizedString(_Reduce, _mp.SynchronizedString):
    pass


class _Served:
    """What the wrapper of a served object does differently: one round trip per access.

    When the lock is served by the same creator, the creator takes it for the access
    (in the thread that serves this one, so a lock this thread holds is re-entered);
    otherwise the access is made under the lock from here.
    """

    _obj: ServedCtypes
    _lock: Any

    def get_obj(self) -> Any:
        raise _no_buffer(self._obj.fiber_type.__name__)

    def _via(self) -> int:
        ref = getattr(self._lock, "fiber_ref", None)
        semlock = getattr(self._lock, "_semlock", None)
        if ref is not None and isinstance(getattr(semlock, "_remote", None), Remote) \
                and ref.token == self._obj.fiber_ref.token:
            return ref.oid
        return 0

    def _get(self, key: Any) -> Any:
        oid = self._via()
        if oid:
            return self._obj.fiber_get(key, oid)
        with self._lock:
            return self._obj.fiber_get(key)

    def _set(self, key: Any, value: Any) -> None:
        oid = self._via()
        if oid:
            self._obj.fiber_set(key, value, oid)
        else:
            with self._lock:
                self._obj.fiber_set(key, value)

    def __len__(self) -> int:
        return len(self._obj)

    def __getitem__(self, key: Any) -> Any:
        return self._get(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._set(key, value)


def _served_property(name: str) -> property:
    return property(lambda self: self._get(name), lambda self, value: self._set(name, value))


class ServedSynchronized(_Served, Synchronized):
    value = _served_property("value")


class ServedSynchronizedArray(_Served, SynchronizedArray):
    pass


class ServedSynchronizedString(_Served, SynchronizedString):
    value = _served_property("value")
    raw = _served_property("raw")


_struct_classes: weakref.WeakKeyDictionary[type, type] = weakref.WeakKeyDictionary()
_served_struct_classes: weakref.WeakKeyDictionary[type, type] = weakref.WeakKeyDictionary()


def synchronized(obj: Any, lock: Any = None, ctx: Any = None) -> Any:
    """A wrapper of ``obj`` whose accesses take ``lock`` (a new RLock by default)."""
    assert not isinstance(obj, _mp.SynchronizedBase), "object already synchronized"
    lock = lock or RLock()
    if isinstance(obj, ServedCtypes):
        type_ = obj.fiber_type
        if issubclass(type_, _SimpleCData):
            return ServedSynchronized(obj, lock)
        if issubclass(type_, ctypes.Array):
            if type_._type_ is ctypes.c_char:
                return ServedSynchronizedString(obj, lock)
            return ServedSynchronizedArray(obj, lock)
        return _struct_class(type_, served=True)(obj, lock)
    if isinstance(obj, _SimpleCData):
        return Synchronized(obj, lock)
    if isinstance(obj, ctypes.Array):
        if obj._type_ is ctypes.c_char:
            return SynchronizedString(obj, lock)
        return SynchronizedArray(obj, lock)
    return _struct_class(_base_of(type(obj)), served=False)(obj, lock)


def _struct_class(cls: type, served: bool) -> type:
    """The wrapper class of a Structure type: a property for each field (one class per type)."""
    cache = _served_struct_classes if served else _struct_classes
    scls = cache.get(cls)
    if scls is None:
        names = [field[0] for field in getattr(cls, "_fields_", ())]
        if served:
            d = {name: _served_property(name) for name in names}
            scls = type("Synchronized" + cls.__name__, (_Served, SynchronizedBase), d)
        else:
            d = {name: _make_property(name) for name in names}
            scls = type("Synchronized" + cls.__name__, (SynchronizedBase,), d)
        cache[cls] = scls
    return scls


__all__ = ["Array", "BufferWrapper", "RawArray", "RawValue", "ServedCtypes", "SharedBufferError", "Synchronized",
           "SynchronizedArray", "SynchronizedBase", "SynchronizedString", "Value", "copy",
           "synchronized", "typecode_to_type"]
