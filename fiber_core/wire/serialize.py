"""Authenticated message connections between the processes of a run.

Every byte stream between two processes of a Fiber program is a plain socket: a
Unix socket when both ends are on one host, TCP otherwise. A connection starts
with a mutual challenge-response (a keyed BLAKE2b MAC) with the run's secret key, and
nothing is unpickled before it succeeds, so a stranger who reaches an open port
gets nothing run. After that, messages are length-prefixed frames.

This module also holds :func:`Pipe` and :func:`wait`, the counterparts of
:func:`multiprocessing.Pipe` and :func:`multiprocessing.connection.wait`.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import sys
import threading
from multiprocessing.reduction import ForkingPickler
from types import CodeType, FunctionType

from fiber_core.base.blake2 import blake2b
from fiber_core.base.errors import PicklingError

TYPE_CHECKING = False  # typing's own, without importing typing: a job starts without it
if TYPE_CHECKING:
    from typing import Any

_SMALL = 64 * 1024


# Exact types that cloudpickle pickles exactly as pickle does (the C pickler handles
# them before it asks cloudpickle); for small messages plain pickle is ~4x faster.
# Not for big ones: pickle.dumps slows down sharply past its 64 KiB frame size.
_SCALARS = frozenset({type(None), bool, int, float})


_BUFFERS = frozenset({str, bytes, bytearray})


def _small_plain(obj: Any) -> bool:
    t = type(obj)
    if t in _SCALARS or t is range:  # a range: the chunks of a map over one
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
            blob = _load_cloudpickle().dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            return _main_object, (name, fingerprint(obj), blob)
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


def fingerprint(obj: Any) -> bytes:
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
    return blake2b(b"\0".join(parts), digest_size=16).digest()


def _main_object(name: str, expected: bytes, blob: bytes) -> Any:
    """Unpickle a main-module function or class: this job's own copy if it has the same one."""
    main = sys.modules.get("__main__")
    obj = getattr(main, name, None)
    if isinstance(obj, (type, FunctionType)) and fingerprint(obj) == expected:
        return obj
    return pickle.loads(blob)


_picklers = threading.local()  # a pickler per thread, reused: making one costs twice a dump
_REGISTERED: dict[Any, Any] = ForkingPickler._extra_reducers  # type: ignore[attr-defined]  # what multiprocessing.reduction.register adds  # noqa: SLF001 - multiprocessing.reduction keeps its registered reducers private
_table: tuple[int, dict[Any, Any]] = (-1, {})


def _dispatch_table() -> dict[Any, Any]:
    """copyreg's reducers plus those registered with ``multiprocessing.reduction``.

    The stdlib's pickler for processes honours both (``ForkingPickler.register``:
    its own ``Connection`` and ``socket``, and whatever a program registers), so
    Fiber's does too: a stdlib ``Connection`` sent through a Fiber Pipe or Queue
    arrives as a working connection on the same host, as it does under spawn.
    The merged table is rebuilt only when one of the two registries grew.
    """
    global _table
    key = len(copyreg.dispatch_table) << 20 | len(_REGISTERED)
    if key != _table[0]:
        merged = dict(copyreg.dispatch_table)
        merged.update(_REGISTERED)
        _table = (key, merged)
    return _table[1]


def _plain_dumps(obj: Any) -> bytes:
    reusable = getattr(_picklers, "free", None)
    _picklers.free = None  # taken (a nested dump, from a __reduce__, makes its own)
    if reusable is None:
        buf = io.BytesIO()
        pickler = _Pickler(buf, pickle.HIGHEST_PROTOCOL)
    else:
        buf, pickler = reusable
    table = _dispatch_table()
    if getattr(pickler, "dispatch_table", None) is not table:
        pickler.dispatch_table = table
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


_cloudpickle: Any = None  # the module, set only once its import has finished


def _load_cloudpickle() -> Any:
    """cloudpickle, fully imported, from any thread.

    ``sys.modules`` holds a module from the moment its import begins, so another
    thread may find it there half-initialised; the import statement instead waits
    for an import that another thread has begun.
    """
    global _cloudpickle
    if _cloudpickle is None:
        import cloudpickle  # on first use: a job that sends only plain data starts without it

        _cloudpickle = cloudpickle
    return _cloudpickle


def _by_value_registered() -> bool:
    """Whether modules were registered with cloudpickle to be pickled by value."""
    if _cloudpickle is None and "cloudpickle" not in sys.modules:
        return False  # never imported, so nothing registered
    return bool(getattr(_load_cloudpickle().cloudpickle, "_PICKLE_BY_VALUE_MODULES", True))


def dumps(obj: Any) -> bytes:
    """Pickle ``obj`` for another process (cloudpickle: lambdas and ``__main__`` work)."""
    if _small_plain(obj):
        return pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    if not _by_value_registered():
        try:
            return _plain_dumps(obj)
        except Exception:
            pass  # a lambda, a closure, a local or __main__ class: by value, then
    cloudpickle = _load_cloudpickle()
    try:
        return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        # Python 3.14's pickler notes where in the object the failure is ("when serializing
        # dict item 'lock'"): in the message, which may be all a log shows.
        where = "; ".join(getattr(e, "__notes__", None) or ())
        raise PicklingError(
            f"cannot send {type(obj).__name__} object to another process: {e}"
            + (f" ({where})" if where else "")
        ) from e


loads = pickle.loads
