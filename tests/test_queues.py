"""``Queue``, ``SimpleQueue`` and ``JoinableQueue`` between real processes."""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections import Counter

import pytest

import fiber_core
import fiber_core.parallel.queue_serve
import fiber_core.parallel.queues

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
    while not q._store.waiters:  # white box: the child's get() reached this owner
        assert time.monotonic() < deadline
        time.sleep(0.01)
    p.terminate()
    p.join(T)
    q.put("precious")
    assert in_child(q.get) == "precious"


def test_unpicklable_item_fails_in_put() -> None:
    q = fiber_core.Queue()
    with pytest.raises(fiber_core.base.errors.PicklingError):
        q.put(threading.Lock())
    assert q.empty()


# -- lending: a handle that gets in a tight loop borrows items in batches ----------------


def _drain_and_report(q: fiber_core.Queue, n: int, report: fiber_core.Queue) -> None:
    got, held = [], 0
    for _ in range(n):
        got.append(q.get(timeout=T))
        if q._borrower is not None:  # white box: items lent to this handle, not yet taken
            held = max(held, len(q._borrower.items))
    report.put((got, held))


def test_a_fast_consumer_borrows_and_gets_every_item_once_in_order() -> None:
    q, report = fiber_core.Queue(), fiber_core.Queue()
    for i in range(3000):
        q.put(i)
    p = fiber_core.Process(target=_drain_and_report, args=(q, 3000, report))
    p.start()
    got, held = report.get(timeout=T)
    p.join(T)
    assert p.exitcode == 0
    assert got == list(range(3000))
    assert held > 1  # it did borrow: the test below relies on it
    assert q.qsize() == 0


def _take_then_hold(q: fiber_core.Queue, n: int, report: fiber_core.Queue,
                    release: fiber_core.Queue, slow_acks: bool = False) -> None:
    if slow_acks:  # white box: no acknowledgement goes out before this process ends
        fiber_core.parallel.queues._ACK_DELAY = 10 * T
    taken = [q.get(timeout=T) for _ in range(n)]
    held = len(q._borrower.items) if q._borrower is not None else 0
    report.put((taken, held))
    release.get()  # busy elsewhere: it takes nothing more from ``q``


def _lend_to_a_child(n: int, take: int, maxsize: int = 0, exit_at_once: bool = False,
                     slow_acks: bool = False) -> tuple:
    """A queue of ``range(n)`` and a child that took ``take`` items and borrowed more.

    Returns ``(q, release, p, taken, held)``; ``release.put(None)`` lets the child end
    (at once with ``exit_at_once``). ``held`` is how many borrowed items it kept.
    """
    q, report, release = fiber_core.Queue(maxsize), fiber_core.Queue(), fiber_core.Queue()
    for i in range(n):
        q.put(i)
    if exit_at_once:
        release.put(None)
    p = fiber_core.Process(target=_take_then_hold, args=(q, take, report, release, slow_acks))
    p.start()
    taken, held = report.get(timeout=T)
    return q, release, p, taken, held


@pytest.fixture
def no_idle_recall(monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner does not fetch items back from idle borrowers: only getters can recall."""
    monkeypatch.setattr(fiber_core.parallel.queue_serve, "_IDLE_LOAN", 10 * T)


def _wait_for_acks(q: fiber_core.Queue, outstanding: int) -> None:
    """Wait until the owner knows what was taken: ``outstanding`` items waiting or lent.

    Taken items are acknowledged about a millisecond later; a borrower killed before
    that gets its last items delivered again (documented), which the tests that kill
    one must not mistake for a bug.
    """
    deadline = time.monotonic() + T
    while q._store.room_used() != outstanding:  # white box: the owner's own count
        assert time.monotonic() < deadline, (q._store.room_used(), outstanding)
        time.sleep(0.005)


@pytest.mark.parametrize("end", ["stays", "killed", "exits"])
def test_items_lent_to_a_consumer_that_stops_taking_reach_other_getters(
        end: str, no_idle_recall: None) -> None:
    n = 2000
    q, release, p, taken, held = _lend_to_a_child(n, 100)
    assert held > 0  # items were lent and are still with the child
    _wait_for_acks(q, n - len(taken))
    if end == "killed":
        p.kill()
        p.join(T)
    elif end == "exits":
        release.put(None)
        p.join(T)
        assert p.exitcode == 0
    # Stays: the owner recalls the lent items; otherwise they come back with the connection.
    rest = [q.get(timeout=T) for _ in range(n - len(taken))]
    assert sorted(taken + rest) == list(range(n))  # nothing lost, nothing twice
    assert q.empty()
    release.put(None)
    p.join(T)


def test_a_consumer_that_exits_without_a_word_keeps_what_it_took() -> None:
    # No qsize() before it ends: its acknowledgements must still reach the owner first.
    n = 2000
    q, _release, p, taken, held = _lend_to_a_child(n, 100, exit_at_once=True, slow_acks=True)
    assert held > 0
    p.join(T)
    assert p.exitcode == 0
    rest = [q.get(timeout=T) for _ in range(n - len(taken))]
    assert sorted(taken + rest) == list(range(n))
    assert q.empty()


def _drain_while_not_empty(q: fiber_core.Queue, report: fiber_core.Queue) -> None:
    got = []
    while not q.empty():
        got.append(q.get(timeout=T))
    report.put(got)


def test_empty_turns_true_once_a_borrower_took_the_last_item() -> None:
    q, report = fiber_core.Queue(), fiber_core.Queue()
    for i in range(1000):
        q.put(i)
    p = fiber_core.Process(target=_drain_while_not_empty, args=(q, report))
    p.start()
    assert report.get(timeout=T) == list(range(1000))
    p.join(T)
    assert p.exitcode == 0


def _drain_until_none(q: fiber_core.Queue, report: fiber_core.Queue) -> None:
    got = []
    while (item := q.get(timeout=T)) is not None:
        got.append(item)
    report.put(got)


def test_fast_consumers_share_a_queue_without_loss() -> None:
    q, report = fiber_core.Queue(), fiber_core.Queue()
    consumers, n = 3, 5000
    ps = [fiber_core.Process(target=_drain_until_none, args=(q, report)) for _ in range(consumers)]
    for p in ps:
        p.start()
    for i in range(n):
        q.put(i)
    for _ in ps:
        q.put(None)  # one may be borrowed by a consumer that then stops: it is given back
    got = [report.get(timeout=T) for _ in ps]
    for p in ps:
        p.join(T)
        assert p.exitcode == 0
    assert sorted(sum(got, [])) == list(range(n))
    assert q.empty()




def _echo_from_threads(q: fiber_core.Queue, out: fiber_core.Queue, threads: int) -> None:
    def echo() -> None:
        while (item := q.get(timeout=T)) is not None:
            out.put(item)

    workers = [threading.Thread(target=echo) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    out.put(None)


def test_threads_of_one_borrowing_handle_get_every_item_once_in_bursts_and_in_lock_step() -> None:
    # The threads share one borrowing connection: one reads the answer to its request,
    # the others wait for it or for their own.
    q, out, threads = fiber_core.Queue(), fiber_core.Queue(), 4
    p = fiber_core.Process(target=_echo_from_threads, args=(q, out, threads))
    p.start()
    for i in range(2000):  # a burst: loans of many items
        q.put(i)
    got = [out.get(timeout=T) for _ in range(2000)]
    for i in range(2000, 2300):  # lock-step: every get finds the queue empty
        q.put(i)
        got.append(out.get(timeout=T))
    for _ in range(threads):
        q.put(None)
    assert out.get(timeout=T) is None
    p.join(T)
    assert p.exitcode == 0
    assert sorted(got) == list(range(2300))
    assert got[2000:] == list(range(2000, 2300))
    assert q.empty()


class _Interrupted(Exception):
    pass


def _get_interrupted_then_go_on(q: fiber_core.Queue, first: int, rest: int,
                                report: fiber_core.Queue) -> None:
    import signal

    def interrupt(signum: int, frame: object) -> None:
        raise _Interrupted

    signal.signal(signal.SIGALRM, interrupt)
    got = [q.get(timeout=T) for _ in range(first)]  # a tight loop: the handle borrows
    assert q._borrower is not None  # white box: what this test is about
    signal.setitimer(signal.ITIMER_REAL, 0.2)  # the next get waits, reading its own answer
    try:
        got.append(q.get(timeout=T))
        interrupted = False
    except _Interrupted:
        interrupted = True
    report.put(interrupted)
    got += [q.get(timeout=T) for _ in range(rest)]  # its request's answer comes all the same
    report.put(got)


def test_a_getter_interrupted_while_it_reads_its_answer_leaves_the_answer_to_the_next_get() -> None:
    q, report = fiber_core.Queue(), fiber_core.Queue()
    for i in range(50):
        q.put(i)
    p = fiber_core.Process(target=_get_interrupted_then_go_on, args=(q, 50, 100, report))
    p.start()
    assert report.get(timeout=T) is True  # interrupted with its request out
    for i in range(50, 150):
        q.put(i)
    assert report.get(timeout=T) == list(range(150))
    p.join(T)
    assert p.exitcode == 0


def test_a_bounded_queue_counts_lent_items_against_its_size(no_idle_recall: None) -> None:
    q, _release, p, taken, held = _lend_to_a_child(50, 10, maxsize=50)
    assert held > 0
    _wait_for_acks(q, 50 - len(taken))
    assert not q.full()
    for i in range(50, 50 + len(taken)):
        q.put(i, timeout=T)  # the borrowed items keep their room: only the taken ones made some
    assert q.full() and q._store.lent > 0  # full, with borrowed items still out
    with pytest.raises(queue.Full):
        q.put("one too many", block=False)
    p.kill()
    p.join(T)
    rest = [q.get(timeout=T) for _ in range(50)]
    assert sorted(taken + rest) == list(range(50 + len(taken)))


def test_polling_get_nowait_reaches_items_lent_to_a_borrower_that_stopped(
        no_idle_recall: None) -> None:
    n = 1000
    q, release, p, taken, held = _lend_to_a_child(n, 100)
    assert held > 0
    _wait_for_acks(q, n - len(taken))
    rest, deadline = [], time.monotonic() + T
    while len(rest) < n - len(taken):
        assert time.monotonic() < deadline
        try:
            rest.append(q.get_nowait())
        except queue.Empty:
            time.sleep(0.001)
    assert sorted(taken + rest) == list(range(n))
    release.put(None)
    p.join(T)


def test_items_lent_to_an_idle_borrower_come_back_in_order_without_a_waiting_getter() -> None:
    n = 1000
    q, release, p, taken, held = _lend_to_a_child(n, 100)
    assert held > 0
    deadline = time.monotonic() + T
    while q._store.lent:  # white box: nobody waits, yet the idle borrower is asked back
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert q.qsize() == n - len(taken)
    assert [q.get(timeout=T) for _ in range(n - len(taken))] == list(range(len(taken), n))
    release.put(None)
    p.join(T)


def _take_all_then_say_so(q: fiber_core.Queue, n: int, said: fiber_core.Queue,
                          release: fiber_core.Queue) -> None:
    for _ in range(n):
        q.get(timeout=T)
    said.put("took them all")
    release.get()  # stays alive: its acknowledgements may still be on their way


def test_a_borrower_that_says_it_took_everything_leaves_the_queue_empty() -> None:
    # The acknowledgements travel apart from the message: lent items must not count.
    for _ in range(5):
        q, said, release = fiber_core.Queue(), fiber_core.Queue(), fiber_core.Queue()
        for i in range(500):
            q.put(i)
        p = fiber_core.Process(target=_take_all_then_say_so, args=(q, 500, said, release))
        p.start()
        assert said.get(timeout=T) == "took them all"
        assert q.empty() and q.qsize() == 0
        release.put("bye")
        p.join(T)
        assert p.exitcode == 0


def _take_in_two_rounds(q: fiber_core.Queue, report: fiber_core.Queue,
                        release: fiber_core.Queue) -> None:
    first = [q.get(timeout=T) for _ in range(100)]
    report.put((first, len(q._borrower.items)))
    release.get()
    report.put([q.get(timeout=T) for _ in range(200)])


def test_a_borrower_whose_connection_ends_serves_nothing_the_owner_took_back() -> None:
    # As when a host is cut off for longer than peer_timeout while both processes live.
    q, report, release = fiber_core.Queue(), fiber_core.Queue(), fiber_core.Queue()
    n = 2000
    for i in range(n):
        q.put(i)
    p = fiber_core.Process(target=_take_in_two_rounds, args=(q, report, release))
    p.start()
    first, held = report.get(timeout=T)
    assert held > 0
    _wait_for_acks(q, n - len(first))
    with q._store.lock:  # white box: end the borrower's connection from the owner's side
        loans = list(q._store.loans.values())
    assert loans
    for loan in loans:
        loan.conn._socket().shutdown(socket.SHUT_RDWR)
    release.put(None)
    second = report.get(timeout=T)
    rest = [q.get(timeout=T) for _ in range(n - len(first) - len(second))]
    assert sorted(first + second + rest) == list(range(n))
    p.join(T)
    assert p.exitcode == 0


def test_an_item_sent_to_a_getter_that_ends_before_it_arrived_goes_back() -> None:
    # Spoken by hand, as a getter killed between the owner's send and its own QUEUE_GOT would.
    from fiber_core.connection import Connection
    from fiber_core.runtime.hub import dial
    from fiber_core.runtime.run import runtime
    from fiber_core.wire import messages
    from fiber_core.wire.serialize import loads

    q = fiber_core.Queue()
    q.put("precious")
    conn = Connection(dial(q._hub, runtime().authkey, f"queue:{q._id}"))
    conn.send_frame(messages.encode_queue_get(True, None))
    reply = conn.recv_bytes()
    assert messages.kind_of(reply) == messages.QUEUE_ITEM
    assert loads(messages.body(reply)) == "precious"
    conn.close()  # without saying it arrived
    assert q.get(timeout=T) == "precious"


@pytest.mark.parametrize("frame", ["a process's frame", "an acknowledgement", "an empty frame"])
def test_a_frame_a_queue_connection_does_not_take_ends_that_connection_only(frame: str) -> None:
    from fiber_core.connection import Connection
    from fiber_core.runtime.hub import dial
    from fiber_core.runtime.run import runtime
    from fiber_core.wire import messages

    sent = {"a process's frame": messages.PROCESS_WAITING,  # not a QUEUE_ kind
            "an acknowledgement": messages.encode_queue_ack(1),  # but nothing was borrowed
            "an empty frame": b""}[frame]
    q = fiber_core.Queue()
    q.put("kept")
    conn = Connection(dial(q._hub, runtime().authkey, f"queue:{q._id}"))
    conn.send_frame(sent)
    assert conn.poll(T), "the owner neither answered nor closed the connection"
    with pytest.raises(EOFError):
        conn.recv_bytes()
    conn.close()
    assert in_child(lambda: q.get(timeout=T)) == "kept"


def _pause_until_recalled_then_go_on(q: fiber_core.Queue, n: int, report: fiber_core.Queue) -> None:
    got, recalls = [], 0
    while len(got) < n:
        got.append(q.get(timeout=T))
        b = q._borrower
        if b is not None and b.held() > 1:  # white box: wait until the idle loan is taken back
            deadline = time.monotonic() + T
            while b.held():
                assert time.monotonic() < deadline, "the idle loan was not recalled"
                time.sleep(0.005)
            recalls += 1
    report.put((got, recalls))


def test_a_single_consumer_keeps_fifo_order_across_recalls() -> None:
    q, report = fiber_core.Queue(), fiber_core.Queue()
    n = 3000
    for i in range(n):
        q.put(i)
    p = fiber_core.Process(target=_pause_until_recalled_then_go_on, args=(q, n, report))
    p.start()
    got, recalls = report.get(timeout=T)
    assert got == list(range(n))
    assert recalls > 0
    p.join(T)


def _drop_handles(q: fiber_core.Queue, report: fiber_core.Queue) -> None:
    import gc
    import pickle

    def ours() -> int:
        return sum(t.name.startswith("fiber-queue") for t in threading.enumerate())

    before = ours()
    for _ in range(10):
        handle = pickle.loads(pickle.dumps(q))  # a new handle, as each task would get
        for _ in range(20):
            handle.get(timeout=T)
        assert handle._borrower is not None
        del handle
    gc.collect()
    deadline = time.monotonic() + T
    while ours() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    report.put((before, ours()))


def test_handles_dropped_without_close_leave_no_threads_behind() -> None:
    q, report = fiber_core.Queue(), fiber_core.Queue()
    for i in range(1000):
        q.put(i)
    p = fiber_core.Process(target=_drop_handles, args=(q, report))
    p.start()
    before, after = report.get(timeout=T)
    p.join(T)
    assert after == before
    deadline = time.monotonic() + T
    # What the dropped handles borrowed and did not take comes back; with no borrower
    # left, the owner's recaller thread ends (white box).
    while q.qsize() != 1000 - 200 or q._store.recaller is not None:
        assert time.monotonic() < deadline, (q.qsize(), q._store.recaller)
        time.sleep(0.01)
