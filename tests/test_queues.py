"""``Queue``, ``SimpleQueue`` and ``JoinableQueue`` between real processes."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import Counter

import pytest

import fiber_core

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed

QUEUES = [fiber_core.Queue, fiber_core.SimpleQueue, fiber_core.JoinableQueue]


def _echo(inbox: fiber_core.Queue, outbox: fiber_core.Queue) -> None:
    while (item := inbox.get()) is not None:
        outbox.put(item)


def _via_grandchild(q: fiber_core.Queue) -> None:
    p = fiber_core.Process(target=_put, args=(q, "from grandchild"))
    p.start()
    p.join()


def _put(q: fiber_core.Queue, item: object) -> None:
    q.put(item)


def _produce(q: fiber_core.Queue, who: int, n: int) -> None:
    for i in range(n):
        q.put((who, i))


def _report(fn, report: fiber_core.Queue) -> None:  # noqa: ANN001
    """Run ``fn()`` in the child and put what it returned or the type of what it raised."""
    try:
        report.put(fn())
    except Exception as e:
        report.put(type(e))


def in_child(fn) -> object:  # noqa: ANN001
    report = fiber_core.Queue()
    p = fiber_core.Process(target=_report, args=(fn, report))
    p.start()
    result = report.get(timeout=T)
    p.join(T)
    assert p.exitcode == 0
    return result


@pytest.mark.parametrize("kind", QUEUES, ids=lambda k: k.__name__)
def test_both_directions(kind: type) -> None:
    inbox, outbox = kind(), kind()
    p = fiber_core.Process(target=_echo, args=(inbox, outbox))
    p.start()
    items = [1, "two", {"three": [3.0]}, (4, None), b"\x00" * 10]
    for item in items:
        inbox.put(item)
    assert [outbox.get(timeout=T) for _ in items] == items
    inbox.put(None)
    p.join(T)
    assert p.exitcode == 0


@pytest.mark.parametrize("kind", QUEUES, ids=lambda k: k.__name__)
def test_passed_to_grandchild(kind: type) -> None:
    q = kind()
    p = fiber_core.Process(target=_via_grandchild, args=(q,))
    p.start()
    assert q.get(timeout=T) == "from grandchild"
    p.join(T)
    assert p.exitcode == 0


def test_get_timeout_raises_empty() -> None:
    q = fiber_core.Queue()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.01)
    with pytest.raises(queue.Empty):
        q.get_nowait()
    assert in_child(lambda: q.get(timeout=0.01)) is queue.Empty
    assert in_child(lambda: q.get(block=False)) is queue.Empty


def test_full_bounded_queue() -> None:
    q = fiber_core.Queue(maxsize=2)
    q.put(1)
    q.put(2)
    assert q.full() and q.qsize() == 2
    with pytest.raises(queue.Full):
        q.put_nowait(3)
    with pytest.raises(queue.Full):
        q.put(3, timeout=0.01)
    assert in_child(lambda: q.put(3, block=False)) is queue.Full
    assert in_child(lambda: q.put(3, timeout=0.01)) is queue.Full
    assert in_child(lambda: (q.get(), q.put(4, block=False), q.full())) == (1, None, True)
    assert [q.get(timeout=T) for _ in range(2)] == [2, 4]


def test_blocked_put_resumes_when_a_child_gets() -> None:
    q = fiber_core.Queue(maxsize=1)
    q.put("first")
    done = threading.Event()
    threading.Thread(target=lambda: (q.put("second"), done.set()), daemon=True).start()
    assert not done.is_set()
    assert in_child(q.get) == "first"
    assert done.wait(T)
    assert q.get(timeout=T) == "second"


def test_qsize_empty_full() -> None:
    q = fiber_core.Queue(maxsize=3)
    assert (q.qsize(), q.empty(), q.full()) == (0, True, False)
    assert in_child(lambda: (q.qsize(), q.empty(), q.full())) == (0, True, False)
    for i in range(3):
        q.put(i)
    assert (q.qsize(), q.empty(), q.full()) == (3, False, True)
    assert in_child(lambda: (q.qsize(), q.empty(), q.full())) == (3, False, True)
    unbounded = fiber_core.SimpleQueue()
    unbounded.put(1)
    assert in_child(lambda: (unbounded.empty(), unbounded.get(), unbounded.empty())) == (False, 1, True)


def _drain(q: fiber_core.JoinableQueue, n: int, go: fiber_core.Queue) -> None:
    items = [q.get() for _ in range(n)]
    go.get()
    for _ in items:
        q.task_done()


def test_task_done_and_join_across_processes() -> None:
    q, go = fiber_core.JoinableQueue(), fiber_core.Queue()
    for i in range(3):
        q.put(i)
    p = fiber_core.Process(target=_drain, args=(q, 3, go))
    p.start()
    joined = threading.Event()
    threading.Thread(target=lambda: (q.join(), joined.set()), daemon=True).start()
    assert not joined.wait(0.1)  # no task_done() can have happened before "go"
    go.put("go")
    assert joined.wait(T)
    p.join(T)
    assert p.exitcode == 0
    assert in_child(q.join) is None  # nothing unfinished: returns at once in a child too


def test_task_done_too_many_times() -> None:
    q = fiber_core.JoinableQueue()
    with pytest.raises(ValueError, match="too many"):
        q.task_done()
    q.put("x")
    assert in_child(lambda: (q.get(), q.task_done())) == ("x", None)
    assert in_child(q.task_done) is ValueError


@pytest.mark.parametrize("kind", QUEUES, ids=lambda k: k.__name__)
def test_put_and_get_after_close(kind: type) -> None:
    q = kind()
    q.put(1)
    q.close()
    with pytest.raises(ValueError, match="closed"):
        q.put(2)
    with pytest.raises(ValueError, match="closed"):
        q.get()
    assert in_child(lambda: (q.close(), q.put(3))) is ValueError


def test_one_megabyte_items_intact() -> None:
    inbox, outbox = fiber_core.Queue(), fiber_core.Queue()
    p = fiber_core.Process(target=_echo, args=(inbox, outbox))
    p.start()
    blobs = [os.urandom(1 << 20) for _ in range(3)]
    for blob in blobs:
        inbox.put(blob)
    assert [outbox.get(timeout=T) for _ in blobs] == blobs
    inbox.put(None)
    p.join(T)
    assert p.exitcode == 0


def test_many_producers_one_consumer() -> None:
    q = fiber_core.Queue()
    producers, n = 4, 250
    ps = [fiber_core.Process(target=_produce, args=(q, w, n)) for w in range(producers)]
    for p in ps:
        p.start()
    got = Counter(q.get(timeout=T) for _ in range(producers * n))
    for p in ps:
        p.join(T)
        assert p.exitcode == 0
    assert set(got) == {(w, i) for w in range(producers) for i in range(n)}
    assert set(got.values()) == {1}
    assert q.empty()


def test_items_from_one_producer_keep_their_order() -> None:
    q = fiber_core.Queue()
    p = fiber_core.Process(target=_produce, args=(q, 0, 200))
    p.start()
    assert [q.get(timeout=T)[1] for _ in range(200)] == list(range(200))
    p.join(T)


def _block_in_get(q: fiber_core.Queue) -> None:
    q.get()


def test_a_getter_terminated_while_blocked_takes_no_item_with_it() -> None:
    q = fiber_core.Queue()
    p = fiber_core.Process(target=_block_in_get, args=(q,))
    p.start()
    deadline = time.monotonic() + T
    while not q._store.not_empty._waiters:  # white box: the child's get() reached this owner
        assert time.monotonic() < deadline
        time.sleep(0.01)
    p.terminate()
    p.join(T)
    q.put("precious")
    assert in_child(q.get) == "precious"


def test_unpicklable_item_fails_in_put() -> None:
    q = fiber_core.Queue()
    with pytest.raises(fiber_core.errors.PicklingError):
        q.put(threading.Lock())
    assert q.empty()
