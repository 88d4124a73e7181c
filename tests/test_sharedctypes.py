"""Value, Array, RawValue, RawArray, synchronized and copy: in this process and across jobs.

Jobs on the creator's host map the shared memory (numpy views see every write);
jobs served by the creator (FIBER_SYNC_SERVED=1 here, another host or a container
for real) reach elements and slices through it and are refused buffer access.
"""

from __future__ import annotations

import ctypes
import multiprocessing.sharedctypes
import pickle
import sys

import numpy as np
import pytest
import sync_tasks

import fiber_core
import fiber_core.sharedctypes as sct
from fiber_core.parallel.sharing import SERVED_ENV

T = 30.0  # seconds any wait in these tests may take


class Point(ctypes.Structure):
    _fields_ = [("x", ctypes.c_double), ("y", ctypes.c_int)]


@pytest.fixture(params=["attached", "served"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "served":
        monkeypatch.setenv(SERVED_ENV, "1")
    return request.param


def run(target, *args) -> None:  # noqa: ANN001
    p = fiber_core.Process(target=target, args=args)
    p.start()
    p.join(T)
    assert p.exitcode == 0


# -- in one process: the stdlib's behaviour ------------------------------------------------


def test_typecodes_and_ctypes_types() -> None:
    assert fiber_core.Value("i", 7).value == 7
    assert fiber_core.Value(ctypes.c_double, 2.5).value == 2.5
    assert fiber_core.RawValue("d", 1.5).value == 1.5
    arr = fiber_core.Array("h", [1, 2, 3])
    assert arr[:] == [1, 2, 3] and len(arr) == 3
    assert fiber_core.RawArray(ctypes.c_uint8, 5)[:] == [0] * 5
    assert fiber_core.Array("c", b"hello").value == b"hello"
    for code, ctype in sct.typecode_to_type.items():
        assert isinstance(fiber_core.RawValue(code), ctype)
        assert ctypes.sizeof(fiber_core.RawArray(code, 3)) == 3 * ctypes.sizeof(ctype)


def test_reprs_and_types_like_the_stdlib() -> None:
    assert repr(fiber_core.Value("i", 5)) == "<Synchronized wrapper for c_int(5)>"
    assert repr(fiber_core.RawValue("d", 0.5)) == "c_double(0.5)"
    assert repr(fiber_core.Array("i", 2)).startswith("<SynchronizedArray wrapper for <")
    assert type(fiber_core.RawArray("d", 2)).__name__ == "c_double_Array_2"
    assert isinstance(fiber_core.RawArray("d", 2), ctypes.Array)
    assert isinstance(fiber_core.Value("i"), multiprocessing.sharedctypes.Synchronized)
    assert isinstance(fiber_core.Array("c", 3), multiprocessing.sharedctypes.SynchronizedString)


def test_locks_true_false_and_given() -> None:
    v = fiber_core.Value("i", 1)
    assert isinstance(v.get_lock(), fiber_core.RLock)
    with v.get_lock():  # an RLock: the property's own acquire re-enters it
        v.value += 1
    assert v.value == 2
    raw = fiber_core.Value("i", 3, lock=False)
    assert isinstance(raw, ctypes.c_int) and raw.value == 3
    lock = fiber_core.Lock()
    a = fiber_core.Array("d", 3, lock=lock)
    assert a.get_lock() is lock
    a.acquire()
    assert not lock.acquire(False)
    a.release()
    assert isinstance(fiber_core.Array("i", 2, lock=None).get_lock(), fiber_core.RLock)
    assert isinstance(fiber_core.Array("i", 2, lock=False), ctypes.Array)


def test_indexing_slicing_value_and_raw() -> None:
    a = fiber_core.Array("i", range(10))
    assert a[3] == 3 and a[-1] == 9 and a[2:5] == [2, 3, 4] and a[::3] == [0, 3, 6, 9]
    a[2:5] = [20, 30, 40]
    a[0] = -1
    assert a[:5] == [-1, 1, 20, 30, 40]
    with pytest.raises(IndexError):
        a[10]
    s = fiber_core.Array("c", 5)
    s.value = b"ab"
    assert s.value == b"ab" and s.raw == b"ab\0\0\0"
    s.raw = b"xyzzy"
    assert s[:] == b"xyzzy"


def test_structures_synchronized_and_copy() -> None:
    p = fiber_core.Value(Point, 1.5, 2)
    assert (p.x, p.y) == (1.5, 2)
    p.y = 5
    assert p.get_obj().y == 5
    assert type(p).__name__ == "SynchronizedPoint"
    raw = fiber_core.RawArray(Point, 2)
    raw[1].x = 3.0
    assert raw[1].x == 3.0

    v = fiber_core.RawValue("i", 4)
    w = sct.synchronized(v)
    assert w.value == 4 and isinstance(w.get_lock(), fiber_core.RLock)
    with pytest.raises(AssertionError, match="already synchronized"):
        sct.synchronized(w)
    c = sct.copy(v)
    c.value = 9
    assert v.value == 4 and c.value == 9
    arr = fiber_core.RawArray("d", [1.0, 2.0])
    assert sct.copy(arr)[:] == [1.0, 2.0]


def test_numpy_views_are_the_shared_memory() -> None:
    a = fiber_core.Array("d", 1000)
    view = np.frombuffer(a.get_obj())
    view[:] = np.arange(1000)
    assert a[999] == 999.0
    raw = fiber_core.RawArray("f", 4)
    np.frombuffer(raw, dtype=np.float32)[:] = 0.5
    assert raw[:] == [0.5] * 4


def test_bad_inputs_raise_the_stdlibs_errors() -> None:
    with pytest.raises(TypeError, match="bad typecode or type 'x'"):
        fiber_core.Value("x")
    with pytest.raises(TypeError, match="bad typecode"):
        fiber_core.RawArray("zz", 3)
    with pytest.raises(TypeError, match="bad typecode"):
        fiber_core.Array(int, 3)
    with pytest.raises(ValueError):
        fiber_core.RawArray("i", -1)
    with pytest.raises(AttributeError, match="has no method 'acquire'"):
        fiber_core.Value("i", 1, lock=3)
    with pytest.raises(TypeError):
        fiber_core.Value("i", "not a number")


def test_pickled_in_this_process_it_is_the_same_object() -> None:
    a = fiber_core.Array("i", 3)
    b = pickle.loads(pickle.dumps(a))
    assert b.get_obj() is a.get_obj() and b.get_lock() is a.get_lock()
    raw = fiber_core.RawValue("q", 1)
    assert pickle.loads(pickle.dumps(raw)) is raw


# -- across jobs ------------------------------------------------------------------------------


def test_numpy_writes_of_jobs_are_seen_by_every_process() -> None:
    arr, raw, q = fiber_core.Array("d", 40), fiber_core.RawArray("i", 40), fiber_core.Queue()
    procs = [fiber_core.Process(target=sync_tasks.write_with_numpy, args=(arr, raw, 10 * i, 10 * i + 10, q))
             for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(T)
        assert p.exitcode == 0
    seen = [q.get(timeout=T) for _ in range(4)]
    assert np.frombuffer(arr.get_obj()).tolist() == [float(i + 1) for i in range(40)]
    assert raw[:] == [1] * 40
    # Each job saw at least its own writes, and the last one to finish saw them all.
    assert max(s[0] for s in seen) == sum(range(1, 41)) and max(s[1] for s in seen) == 40


def test_values_incremented_by_jobs_under_their_lock(path: str) -> None:
    value = fiber_core.Value("i", 0)
    n = 200 if path == "attached" else 50
    procs = [fiber_core.Process(target=sync_tasks.increment_value, args=(value, n)) for _ in range(4)]
    for p in procs:
        p.start()
    sync_tasks.increment_value(value, n)
    for p in procs:
        p.join(T)
        assert p.exitcode == 0
    assert value.value == 5 * n


def test_served_arrays_work_by_element_and_refuse_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SERVED_ENV, "1")
    arr, value, q = fiber_core.Array("d", 4), fiber_core.Value("i", 1), fiber_core.Queue()
    run(sync_tasks.write_elements, arr, value, q)
    seen, length, total, refused = q.get(timeout=T)
    assert seen == [10.0, 20.0, 30.0, 40.0] and length == 4 and total == 6
    assert refused.startswith("SharedBufferError: this shared c_double_Array_4 is served by its creator")
    assert "element and slice access" in refused
    assert arr[:] == seen and value.value == 6


SERVED_PROBE = """
import ctypes
import fiber_core
import fiber_core.sharedctypes


class Point(ctypes.Structure):
    _fields_ = [("x", ctypes.c_double), ("y", ctypes.c_int)]

def probe(raw, point, text, q):
    out = [len(raw), raw[1], list(raw), repr(raw).endswith("(served by its creator)")]
    raw[0] = 7
    point.y = 3
    out += [point.x, point.y, text.value, text.raw]
    text.value = b"hi"
    for what in (lambda: memoryview(raw), lambda: raw.__array_interface__, lambda: point.get_obj()):
        try:
            what()
            out.append("no error")
        except (BufferError, TypeError) as e:
            out.append(type(e).__name__)
    copied = fiber_core.sharedctypes.copy(raw)
    out.append((type(copied).__name__, copied[:]))
    q.put(out)

if __name__ == "__main__":
    raw, point = fiber_core.RawArray("i", [1, 2, 3]), fiber_core.Value(Point, 0.5, 1)
    text, q = fiber_core.Array("c", b"abc"), fiber_core.Queue()
    p = fiber_core.Process(target=probe, args=(raw, point, text, q))
    p.start()
    p.join()
    print(q.get(timeout=5) if p.exitcode == 0 else p.exitcode)
    print(raw[:], point.y, text.value, p.exitcode)
"""


def test_served_raw_arrays_structures_and_strings(run_script) -> None:  # noqa: ANN001
    from test_synchronize import WT

    result = run_script(SERVED_PROBE, env={SERVED_ENV: "1", "PYTHONPATH": str(WT)})
    assert result.returncode == 0, result.stderr
    probe, after = result.stdout.splitlines()
    # Before Python 3.12 a class cannot take part in the buffer protocol: memoryview()
    # raises its own TypeError.
    memoryview_error = "SharedBufferError" if sys.version_info >= (3, 12) else "TypeError"
    assert probe == (f"[3, 2, [1, 2, 3], True, 0.5, 3, b'abc', b'abc', "
                     f"'{memoryview_error}', 'SharedBufferError', 'SharedBufferError', "
                     "('c_int_Array_3', [7, 2, 3])]")
    assert after == "[7, 2, 3] 3 b'hi' 0"
