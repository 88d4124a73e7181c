"""A queue owner's store and serving side: its line of waiting getters, on real sockets and threads."""

from __future__ import annotations

import socket
import threading

import pytest
from procs import wait_until

from fiber_core.parallel.queue_serve import Empty, Store, _Loan, _Parked, serve
from fiber_core.wire import messages
from fiber_core.wire.framing import Connection

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed


def _loan() -> tuple[_Loan, Connection]:
    """A borrower's loan on one end of a socket pair, and the borrower's end."""
    ours, theirs = socket.socketpair()
    theirs.settimeout(T)
    return _Loan(Connection(ours), threading.Lock()), Connection(theirs)


def test_a_borrowers_waiting_get_is_answered_by_the_thread_that_puts() -> None:
    store = Store(0)
    loan, borrower = _loan()
    parked = store.lend_or_park(loan, 8, True)
    assert isinstance(parked, _Parked)
    store.put(b"item")  # no other thread runs here: the put itself lends and sends
    reply = borrower.recv_bytes()
    assert messages.kind_of(reply) == messages.QUEUE_ITEM
    assert bytes(messages.body(reply)) == b"item"
    assert (store.lent, list(loan.lent), store.qsize()) == (1, [b"item"], 0)
    assert parked.served and not store.waiters


def test_getters_that_wait_are_served_first_come_first_served() -> None:
    store = Store(0)
    got: list[object] = []
    thread = threading.Thread(target=lambda: got.append(store.get(True, T)))
    thread.start()
    wait_until(lambda: store.waiters, "the thread waits in get()")
    loan, borrower = _loan()
    assert isinstance(store.lend_or_park(loan, 1, True), _Parked)
    store.put_many([b"first", b"second", b"third"])
    thread.join(T)
    assert got == [b"first"]
    assert bytes(messages.body(borrower.recv_bytes())) == b"second"
    assert list(store.items) == [b"third"]


def test_a_timed_get_that_finds_nothing_leaves_the_line_and_the_next_item_waits() -> None:
    store = Store(0)
    with pytest.raises(Empty):
        store.get(True, 0.01)
    store.put(b"kept")
    assert not store.waiters and list(store.items) == [b"kept"]


def _session(store: Store) -> tuple[Connection, threading.Thread]:
    """A client connection that ``serve`` answers in a thread of its own, as a hub's does."""
    ours, theirs = socket.socketpair()
    theirs.settimeout(T)
    thread = threading.Thread(target=serve, args=(store, ours), daemon=True)
    thread.start()
    return Connection(theirs), thread


def test_a_borrowers_get_with_a_timeout_is_answered_empty_once_and_leaves_the_item_to_others() -> None:
    store = Store(0)
    client, thread = _session(store)
    client.send_frame(messages.encode_queue_loan(7))
    client.send_frame(messages.encode_queue_get(True, 0.05, 4))
    assert messages.kind_of(client.recv_bytes()) == messages.QUEUE_EMPTY
    store.put(b"later")
    assert store.get(False) == b"later"  # not lent to the borrower whose get ended
    client.send_frame(messages.QUEUE_SIZE)  # the connection still serves, and sent nothing else
    assert messages.kind_of(client.recv_bytes()) == messages.QUEUE_SIZES
    client.close()
    thread.join(T)
    assert not thread.is_alive()


def test_a_borrower_gone_while_its_get_waits_takes_no_item_with_it() -> None:
    store = Store(0)
    client, thread = _session(store)
    client.send_frame(messages.encode_queue_loan(7))
    client.send_frame(messages.encode_queue_get(True, None, 4))
    wait_until(lambda: store.parked, "the borrower's get waits in the store")
    client.close()
    thread.join(T)
    assert not thread.is_alive()
    store.put(b"precious")
    assert (store.get(False), store.lent, store.loans) == (b"precious", 0, {})


def test_items_a_borrower_gives_back_go_to_a_borrower_whose_get_waits() -> None:
    store = Store(0)
    holder, holder_thread = _session(store)
    holder.send_frame(messages.encode_queue_loan(1))
    store.put_many([b"a", b"b"])
    holder.send_frame(messages.encode_queue_get(True, None, 2))
    assert messages.kind_of(holder.recv_bytes()) == messages.QUEUE_BATCH
    waiter, waiter_thread = _session(store)
    waiter.send_frame(messages.encode_queue_loan(2))
    waiter.send_frame(messages.encode_queue_get(True, None, 4))
    assert messages.kind_of(holder.recv_bytes()) == messages.QUEUE_RECALL  # a getter waits
    holder.send_frame(messages.encode_queue_return(2))
    batch = waiter.recv_bytes()
    assert [bytes(x) for x in messages.decode_queue_batch(batch)] == [b"a", b"b"]
    for client, thread in ((holder, holder_thread), (waiter, waiter_thread)):
        client.close()
        thread.join(T)
    assert list(store.items) == [b"a", b"b"]  # the waiter took nothing: back in front, in order


def test_a_put_does_not_wait_on_a_borrower_that_reads_nothing_and_the_big_item_arrives_whole() -> None:
    store = Store(0)
    loan, borrower = _loan()
    assert isinstance(store.lend_or_park(loan, 1, True), _Parked)
    item = bytes(range(256)) * (1 << 14)  # 4 MiB: more than a socket takes at once
    putter = threading.Thread(target=store.put, args=(item,))
    putter.start()
    putter.join(T)
    assert not putter.is_alive(), "the put waited for the borrower to read"
    reply = borrower.recv_bytes()  # read only now
    assert messages.kind_of(reply) == messages.QUEUE_ITEM
    assert bytes(messages.body(reply)) == item
    store.put(b"next")  # the connection is free again: nothing was left holding it
    assert loan.send_lock.acquire(timeout=T)
    loan.send_lock.release()
