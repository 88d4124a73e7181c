"""The results a Pool's calls return (``AsyncResult``, ``MapResult``, the ``imap`` iterators),
and how a task's failure in a worker becomes the caller's exception.

The master thread fills a result unit by unit (``set_unit``), in any order; the
caller's thread waits on it. A result tells its pool when it is done or cancelled
(the pool's ``end_call`` and ``cancel_call``). What the pool uses of a result is
public (``call_id``, ``set_unit``, ``fail``, ``expire``, ``progress``), as
:class:`concurrent.futures.Future` makes ``set_result`` public for executors.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError
from typing import TYPE_CHECKING, Any

from fiber_core.base.errors import DeadlineError, TaskExitError, TimeoutError
from fiber_core.base.log import log
from fiber_core.base.memory import release_free_memory

if TYPE_CHECKING:
    from fiber_core.parallel.durable.journal import CallKey
    from fiber_core.parallel.pool.facade import Pool
    from fiber_core.parallel.pool.table import Unit

LARGE_MAP = 100_000
"""Results of a map from which the parent gives its allocator's free memory back."""

job_counter = itertools.count()
"""Ids of calls and of batches: one counter, so that no batch id is a call's."""


def check_deadline(deadline: float | None) -> None:
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                 or deadline <= 0):
        raise ValueError(f"deadline must be a number of seconds over 0, or None; not {deadline!r}")


def check_retries(retries: int) -> int:
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise ValueError(f"retries must be an int of 0 or more, not {retries!r}")
    return retries


def call_name(method: str, func: Callable) -> str:
    """How an error names a call: ``map(f)`` (:meth:`Unit.name` adds an item or arguments)."""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    if name is None:
        inner = getattr(func, "func", None)  # a functools.partial
        name = getattr(inner, "__qualname__", None) or type(func).__name__
    return f"{method}({name})"


class RemoteTraceback(Exception):
    """Carries the traceback text of an exception raised in a worker (its ``__cause__``)."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


def rebuild_exc(exc: BaseException, tb: str) -> BaseException:
    exc.__cause__ = RemoteTraceback(f'\n"""\n{tb}"""')
    return exc


def task_error(unit: Unit, ok: bool | None, value: Any) -> BaseException:
    """The caller's exception for a unit that failed in its worker."""
    if ok is None:  # its arguments could not be unpickled in the worker
        message, tb = value
        err: BaseException = TaskExitError(
            f"{unit.name()}: its arguments cannot be unpickled in the worker: {message}")
        return rebuild_exc(err, tb)
    exc, tb = value
    if isinstance(exc, SystemExit):
        err = TaskExitError(f"{unit.name()} called sys.exit({exc.code!r})")
    elif isinstance(exc, KeyboardInterrupt):
        err = TaskExitError(f"{unit.name()} was interrupted (KeyboardInterrupt in the worker)")
    else:
        return rebuild_exc(exc, tb) if tb else exc
    err.__context__ = exc
    return rebuild_exc(err, tb)


class ApplyResult:
    """The result of ``apply_async``; the base of the other result types."""

    def __init__(self, pool: Pool, callback: Callable | None, error_callback: Callable | None,
                 call: str = "apply_async") -> None:
        self._pool = pool
        self._event = threading.Event()
        self.call_nameback = callback
        self._error_callback = error_callback
        self._success = False
        self._value: Any = None
        self.call_id = next(job_counter)
        self.call_name = call  # how errors name the call: apply_async(f)
        self.durable: CallKey | None = None  # its ordinal, what the journal holds of it

    def ready(self) -> bool:
        return self._event.is_set()

    def successful(self) -> bool:
        if not self.ready():
            raise ValueError(f"{self!r} not ready")
        return self._success

    def wait(self, timeout: float | None = None) -> None:
        self._event.wait(timeout)

    def get(self, timeout: float | None = None) -> Any:
        self.wait(timeout)
        if not self.ready():
            raise TimeoutError
        if self._success:
            return self._value
        raise self._value

    def cancel(self) -> bool:
        """Cancel the call's tasks not started yet and stop waiting for running ones (Fiber extension).

        Returns ``False`` if the result was ready already; else ``get()`` then raises
        :class:`concurrent.futures.CancelledError` (no callback is called) and the
        pool no longer counts the call as outstanding.
        """
        if self._event.is_set():
            return False
        return self._pool.cancel_call(self, self._settle_cancelled)

    def _settle_cancelled(self) -> bool:
        # Under the pool's lock: the master thread may have finished the call meanwhile.
        if self._event.is_set():
            return False
        self._success, self._value = False, CancelledError()
        self._event.set()
        return True

    def cancelled(self) -> bool:
        return self._event.is_set() and isinstance(self._value, CancelledError)

    def progress(self) -> dict[str, Any]:
        """The call as the live view shows it: its name, and units done of how many."""
        return {"call": self.call_name, "units_done": int(self.ready()), "units": 1}

    def expire(self, seconds: float) -> None:
        """The deadline passed (master thread, lock held, the call already cancelled)."""
        self._finish(False, DeadlineError(f"{self.call_name}: its deadline of {seconds:g} s passed "
                                          "before it finished; it was cancelled", [None], 0, 1))

    # Called by the master thread.
    def set_unit(self, unit: int, ok: bool, values: Any) -> None:
        self._finish(ok, values[0] if ok else values)

    def _finish(self, ok: bool, value: Any) -> None:
        if self._event.is_set():
            return
        self._success, self._value = ok, value
        cb = self.call_nameback if ok else self._error_callback
        if cb is not None:
            try:
                cb(value)
            except Exception:
                log.exception("fiber: pool callback raised")
        self._event.set()
        self._pool.end_call(self)

    def fail(self, exc: BaseException) -> None:
        self._finish(False, exc)


AsyncResult = ApplyResult


class MapResult(ApplyResult):
    """The result of ``map_async``/``starmap_async``: a list in input order."""

    def __init__(self, pool: Pool, nunits: int, callback: Callable | None,
                 error_callback: Callable | None, call: str = "map", sizes: list[int] | None = None) -> None:
        super().__init__(pool, callback, error_callback, call)
        self._chunks: list[Any] = [None] * nunits
        self._sizes = sizes or []  # items per unit, for a partial result at a deadline
        self._left = nunits
        if nunits == 0:
            self._success, self._value = True, []
            self._event.set()

    def progress(self) -> dict[str, Any]:
        total = len(self._chunks)
        return {"call": self.call_name, "units_done": total - self._left, "units": total}

    def expire(self, seconds: float) -> None:
        results: list = []
        done = 0
        for chunk, size in zip(self._chunks, self._sizes):
            if chunk is None:
                results.extend([None] * size)
            else:
                results.extend(chunk)
                done += size
        self._finish(False, DeadlineError(
            f"{self.call_name}: its deadline of {seconds:g} s passed with {done} of {len(results)} "
            f"tasks finished; the others were cancelled (their results are None in .results)",
            results, done, len(results)))

    def set_unit(self, unit: int, ok: bool, values: Any) -> None:
        if self._event.is_set():
            return
        if not ok:
            self._finish(False, values)
            return
        self._chunks[unit] = values
        self._left -= 1
        if self._left == 0:
            chunks, self._chunks = self._chunks, []
            # One list of the final size, each unit's values moved in and let go at once:
            # no list regrown step by step, no second full copy held at the peak.
            out: list = [None] * sum(map(len, chunks))
            at = 0
            for i, values in enumerate(chunks):
                out[at:at + len(values)] = values
                at += len(values)
                chunks[i] = None
            del chunks, values
            if len(out) >= LARGE_MAP:
                release_free_memory()  # what the map's transient buffers took goes back
            self._finish(True, out)


class IMapIterator:
    """The iterator ``imap`` returns: results in input order, as they arrive."""

    def __init__(self, pool: Pool, call: str = "imap") -> None:
        self._pool = pool
        self._cond = threading.Condition(threading.Lock())
        self._items: collections.deque = collections.deque()
        self._ready: dict[int, tuple[bool, Any]] = {}
        self._next_unit = 0
        self._length: int | None = None  # units, known once the input is consumed
        self._yielded_units = 0
        self.call_id = next(job_counter)
        self.call_name = call  # how errors name the call: imap(f)
        self.durable: CallKey | None = None  # its ordinal, what the journal holds of it
        self._closed = False

    def __iter__(self) -> Iterator:
        return self

    def progress(self) -> dict[str, Any]:
        """The call as the live view shows it: its name, and units done of how many (None: the
        input is not all read yet)."""
        return {"call": self.call_name, "units_done": self._yielded_units + len(self._ready),
                "units": self._length}

    def close(self) -> None:
        """Stop the call, as closing a generator does (Fiber extension).

        Its tasks not started yet never start, running ones are not waited for,
        and the input is read no further: ``islice(it, k)`` then ``close()`` takes
        the first k results of n. ``next()`` raises :class:`StopIteration` after.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._items.clear()
            self._ready.clear()
            self._length = self._yielded_units = max(self._yielded_units, self._length or 0)
            self._cond.notify_all()
        self._pool.cancel_call(self)

    def __enter__(self) -> IMapIterator:
        return self

    def expire(self, seconds: float) -> None:
        self.fail(DeadlineError(
            f"{self.call_name}: its deadline of {seconds:g} s passed; the results before this "
            f"error are what finished, the other tasks were cancelled"))
        with self._cond:
            self._closed = True  # results that come later are dropped

    def __exit__(self, *exc: object) -> None:
        self.close()

    def next(self, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._items:
                    ok, value = self._items.popleft()
                    if ok:
                        return value
                    raise value
                if self._length is not None and self._yielded_units >= self._length:
                    raise StopIteration
                # Woken without news (a unit that came out of order): wait the rest only.
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and (left <= 0 or not self._cond.wait(left)):
                    raise TimeoutError
                if left is None:
                    self._cond.wait()

    __next__ = next

    def _push(self, ok: bool, values: Any) -> None:
        self._yielded_units += 1
        if ok:
            self._items.extend((True, v) for v in values)
        else:
            self._items.append((False, values))

    def set_unit(self, unit: int, ok: bool, values: Any) -> None:
        with self._cond:
            if self._closed:
                return
            self._ready[unit] = (ok, values)
            while self._next_unit in self._ready:
                self._push(*self._ready.pop(self._next_unit))
                self._next_unit += 1
            self._cond.notify_all()
            self._maybe_done()

    def _set_length(self, nunits: int) -> None:
        with self._cond:
            if self._closed:
                return
            self._length = nunits
            self._cond.notify_all()
            self._maybe_done()

    def _maybe_done(self) -> None:
        if self._length is not None and self._yielded_units >= self._length:
            self._pool.end_call(self)

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            self._items.append((False, exc))
            self._length = self._yielded_units + 1 if self._length is None else self._length
            self._yielded_units = self._length
            self._cond.notify_all()
        self._pool.end_call(self)


class IMapUnorderedIterator(IMapIterator):
    """The iterator ``imap_unordered`` returns: results as they complete."""

    def set_unit(self, unit: int, ok: bool, values: Any) -> None:
        with self._cond:
            if self._closed:
                return
            self._push(ok, values)
            self._cond.notify_all()
            self._maybe_done()
