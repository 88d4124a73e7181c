"""Python 3.14's changes to multiprocessing, concurrent.futures and pickle that touch Fiber's
drop-in API, checked on every Python (``scripts/test-pythons.sh`` runs this file on each).

3.14 lists the stdlib's start methods from its table (where Fiber registers ``"fiber"``),
adds ``Process.interrupt()``, ``ProcessPoolExecutor.terminate_workers()``/``kill_workers()``
and ``Executor.map(buffersize=)``, a ``set`` type to ``SyncManager``, and notes to pickling
errors. Fiber offers the new methods on every Python.
"""

from __future__ import annotations

import itertools
import multiprocessing
import multiprocessing.managers
import os
import sys
import threading
from concurrent.futures import CancelledError
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import pytest
from procs import wait_gone

import fiber_core
from fiber_core.base.errors import PicklingError
from fiber_core.futures import ProcessPoolExecutor
from fiber_core.parallel.managers import SyncManager

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed



# -- start methods ------------------------------------------------------------------------


def test_the_stdlibs_list_of_start_methods_leaves_fiber_out() -> None:
    table: Any = multiprocessing.context._concrete_contexts  # type: ignore[attr-defined]
    # 3.14's get_all_start_methods(): the default first, then every name in the table.
    default = multiprocessing.context._default_context._default_context.get_start_method()  # type: ignore[attr-defined]
    as_314_lists = [default, *(name for name in table if name != default)]
    assert "fiber" not in as_314_lists and "fiber" not in multiprocessing.get_all_start_methods()
    assert set(as_314_lists) == set(multiprocessing.get_all_start_methods())
    assert "fiber" not in table and "fiber" not in dict(table)
    # ... and the name is still found, by the stdlib's get_context and in the table.
    assert multiprocessing.get_context("fiber") is fiber_core.get_context() is table["fiber"]
    with pytest.raises(ValueError, match="cannot find context for 'nonesuch'"):
        multiprocessing.get_context("nonesuch")


def test_get_start_method_allow_none_says_whether_one_was_chosen(run_script) -> None:  # noqa: ANN001
    out = run_script("""
        import multiprocessing
        import fiber_core

        seen = [(multiprocessing.get_start_method(allow_none=True), fiber_core.get_start_method(allow_none=True))]
        seen.append(fiber_core.get_start_method())  # asking fixes it, as the stdlib's does
        seen.append(fiber_core.get_start_method(allow_none=True))
        fiber_core.set_start_method(None, force=True)
        seen.append(fiber_core.get_start_method(allow_none=True))
        fiber_core.set_start_method("spawn")
        seen.append(fiber_core.get_start_method(allow_none=True))
        print(seen)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[(None, None), 'fiber', 'fiber', None, 'spawn']"


# -- Process.interrupt() --------------------------------------------------------------------


def _wait_for_interrupt(q: Any) -> None:
    try:
        q.put("ready")
        threading.Event().wait(T)  # until interrupted
    finally:
        q.put("finally ran")


def test_interrupt_raises_keyboardinterrupt_in_the_job() -> None:
    q = fiber_core.Queue()
    p = fiber_core.Process(target=_wait_for_interrupt, args=(q,))
    p.interrupt()  # not started: nothing to do, as terminate()
    p.start()
    assert q.get(timeout=T) == "ready"
    p.interrupt()
    p.join(T)
    assert p.exitcode == 1  # an uncaught KeyboardInterrupt, as under the stdlib
    assert q.get(timeout=T) == "finally ran"
    p.interrupt()  # ended: nothing to do
    p.close()
    with pytest.raises(ValueError, match="closed"):
        p.interrupt()


def _exit_on_sigint(q: Any) -> None:
    import signal

    signal.signal(signal.SIGINT, lambda *_: sys.exit(5))
    q.put("ready")
    threading.Event().wait(T)  # until interrupted


def test_interrupt_runs_the_jobs_own_handler() -> None:
    q = fiber_core.Queue()
    p = fiber_core.Process(target=_exit_on_sigint, args=(q,))
    p.start()
    assert q.get(timeout=T) == "ready"
    p.interrupt()
    p.join(T)
    assert p.exitcode == 5


# -- ProcessPoolExecutor ------------------------------------------------------------------------


def _square(x: int) -> int:
    return x * x


def test_map_with_buffersize_reads_its_input_as_results_are_taken() -> None:
    taken: list[int] = []

    def endless() -> Any:
        for i in itertools.count():
            taken.append(i)
            yield i

    with ProcessPoolExecutor(2) as ex:
        results = ex.map(_square, endless(), buffersize=3)
        assert list(itertools.islice(results, 6)) == [i * i for i in range(6)]
        assert len(taken) <= 6 + 3 + 1  # what was yielded, the buffer, and one refill
        results.close()
        with pytest.raises(ValueError, match="buffersize must be None or > 0"):
            ex.map(_square, [1], buffersize=0)
        with pytest.raises(TypeError, match="buffersize must be an integer or None"):
            ex.map(_square, [1], buffersize=1.5)  # type: ignore[arg-type]
        assert list(ex.map(_square, range(7), chunksize=2, buffersize=2)) == [i * i for i in range(7)]


def _hold(q: Any) -> None:
    q.put(os.getpid())
    threading.Event().wait(T)  # until stopped (bounded: a failing test does not hang the exit)


@pytest.mark.parametrize("how", ["terminate_workers", "kill_workers"])
def test_terminate_and_kill_workers(how: str) -> None:
    q = fiber_core.Queue()
    ex = ProcessPoolExecutor(1)
    running = [ex.submit(_hold, q) for _ in range(2)]  # handed to the pool (2 per worker)
    queued = [ex.submit(_square, i) for i in range(3)]
    worker = q.get(timeout=T)
    getattr(ex, how)()
    for f in running:
        with pytest.raises(BrokenProcessPool):
            f.result(T)
    for f in queued:
        with pytest.raises(CancelledError):
            f.result(T)
    with pytest.raises((BrokenProcessPool, RuntimeError)):
        ex.submit(_square, 1)
    wait_gone(worker)
    ex.shutdown()
    getattr(ProcessPoolExecutor(1), how)()  # never used: nothing to stop


# -- managers and pickling ------------------------------------------------------------------------


def test_the_sync_manager_serves_every_stdlib_type() -> None:
    # 3.14 adds SyncManager.set(), and methods to the list and dict proxies: Fiber's manager
    # serves the stdlib's registry and proxies, so they come with the Python.
    assert set(multiprocessing.managers.SyncManager._registry) <= set(SyncManager._registry)
    with fiber_core.Manager() as m:
        d, lst = m.dict(a=1), m.list([1, 2])
        d["b"] = 2
        lst.append(3)
        assert (dict(d), list(lst)) == ({"a": 1, "b": 2}, [1, 2, 3])
        if "set" in multiprocessing.managers.SyncManager._registry:  # 3.14
            s = m.set([1])
            s.add(2)
            assert set(s) == {1, 2}


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are new in 3.11")
def test_a_pickling_error_names_where_it_failed() -> None:
    class Unpicklable:
        def __reduce__(self) -> Any:
            e = TypeError("cannot pickle this")
            e.add_note("when serializing dict item 'x'")  # as 3.14's pickler notes it
            raise e

    with pytest.raises(PicklingError) as info:
        fiber_core.Process(target=print, args=({"x": Unpicklable()},)).start()
    assert str(info.value).endswith("cannot pickle this (when serializing dict item 'x')"), str(info.value)
