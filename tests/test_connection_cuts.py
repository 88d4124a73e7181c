"""A connection of a Queue, a Pipe or a Manager cut while both processes live.

The process that does not own the object shuts its socket down itself (what a reset by the
network or ``ss -K`` does to it) at a point of its own progress. Each object either delivers
every message once and then raises on both sides, or reports what may come twice or may be
lost: never a silent duplicate, never a silent loss.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest
from procs import wait_until

import fiber_core
from fiber_core.base.errors import PipeCutError, QueueCutError

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed


def take_cut_and_go_on(q: Any, out: Any, before: int, total: int) -> None:
    got = [q.get(timeout=T) for _ in range(before)]
    q._borrower.conn._socket().shutdown(socket.SHUT_RDWR)  # the connection is cut
    reported = at = None
    while len(set(got)) < total:
        try:
            got.append(q.get(timeout=T))
        except QueueCutError as e:
            assert reported is None, "reported once"
            reported, at = e.taken, len(got)
        except fiber_core.queues.Empty:
            break
    out.put((got, reported, at))


def test_items_taken_before_a_cut_are_reported_not_silently_delivered_twice() -> None:
    n, before = 3000, 500
    q, out = fiber_core.Queue(), fiber_core.Queue()
    for i in range(n):
        q.put(i)
    p = fiber_core.Process(target=take_cut_and_go_on, args=(q, out, before, n))
    p.start()
    got, reported, at = out.get(timeout=T)
    p.join(T)
    assert p.exitcode == 0
    assert reported is not None and reported > 0  # lent in batches, acknowledged later
    twice = [x for x in set(got) if got.count(x) > 1]
    assert sorted(set(got)) == list(range(n))  # nothing lost
    assert len(got) == n + reported  # each duplicate was reported ...
    # ... and is one of those it took last before the error (the lent ones still here were
    # handed out until the handle saw the cut)
    assert sorted(twice) == sorted(got[at - reported:at])


def send_and_cut(end: Any, k: int, n: int, out: Any) -> None:
    sent, err = 0, None
    try:
        for i in range(n):
            if i == k:
                end._socket().shutdown(socket.SHUT_RDWR)  # the connection is cut
            end.send(i)
            sent += 1
    except OSError as e:
        err = type(e).__name__
    out.put((sent, err))


def test_a_pipe_whose_writing_copy_is_cut_delivers_what_was_sent_then_raises_on_both_sides() -> None:
    a, b = fiber_core.Pipe()
    out = fiber_core.Queue()
    p = fiber_core.Process(target=send_and_cut, args=(b, 500, 1000, out))
    p.start()
    b.close()
    got = []
    with pytest.raises(EOFError):
        while True:
            assert a.poll(T), "the reader is not left waiting"
            got.append(a.recv())
    sent, err = out.get(timeout=T)
    p.join(T)
    assert err in ("BrokenPipeError", "ConnectionResetError"), err
    assert got == list(range(sent))  # every message sent, once, in order


def receive_and_cut(end: Any, k: int, out: Any) -> None:
    got, err = [], None
    try:
        while True:
            if len(got) == k:
                end._socket().shutdown(socket.SHUT_RDWR)  # the connection is cut
            got.append(end.recv())
    except EOFError as e:
        err = type(e).__name__
    out.put((got, err))


def test_a_pipe_whose_reading_copy_is_cut_raises_on_both_sides_with_what_may_be_lost() -> None:
    a, b = fiber_core.Pipe()
    out = fiber_core.Queue()
    p = fiber_core.Process(target=receive_and_cut, args=(b, 500, out))
    p.start()
    b.close()
    sent = 0
    with pytest.raises(PipeCutError) as cut:
        for i in range(10**6):
            a.send(i)
            sent += 1
    got, err = out.get(timeout=T)
    p.join(T)
    assert p.exitcode == 0
    assert err == "PipeCutError"  # the reader is told too, not handed a plain end of file
    assert got == list(range(len(got)))  # in order, none twice
    # Every message whose send returned arrived, but those the error counts.
    unknown = cut.value.unacknowledged
    assert unknown > 0 and sent - unknown <= len(got) <= sent
    with pytest.raises(BrokenPipeError):
        a.send("after")  # raised once: then, no reader being left, the usual error


def take_cut_and_report(end: Any, k: int, out: Any) -> None:
    end.poll(0)  # in use: with the reader in the creator, messages are queued and asked for
    out.put("ready")
    got = [end.recv() for _ in range(k)]
    end._socket().shutdown(socket.SHUT_RDWR)  # the connection is cut
    try:
        got.append(end.recv())
        err = None
    except PipeCutError as e:
        err = e.received
    out.put((got, err))


def read_to_the_end(end: Any, out: Any) -> None:
    got = []
    try:
        while True:
            got.append(end.recv())
    except EOFError:
        pass
    out.put(got)


def test_a_message_a_cut_reader_of_a_shared_end_took_is_not_handed_to_another() -> None:
    n, k = 1000, 300
    a, b = fiber_core.Pipe()
    first, second = fiber_core.Queue(), fiber_core.Queue()
    cut = fiber_core.Process(target=take_cut_and_report, args=(b, k, first))
    cut.start()
    assert first.get(timeout=T) == "ready"
    b.poll(0)  # a reader here as well: the pipe goes through its queue, and stays open
    for i in range(n):
        a.send(i)
    got_cut, received = first.get(timeout=T)
    cut.join(T)
    assert cut.exitcode == 0 and received == k  # the cut reader is told, with what it took
    state = a._state
    wait_until(lambda: not state.machine.copies, "the cut copy is let go")
    other = fiber_core.Process(target=read_to_the_end, args=(b, second))
    other.start()
    a.close()
    got_other = second.get(timeout=T)
    other.join(T)
    # What the cut reader took (acknowledged before its recv returned) is its own; what was
    # on its way to it goes to the other reader: each message once.
    assert got_cut == list(range(k))
    assert sorted(got_cut + got_other) == list(range(n))


def append_and_cut(lst: Any, k: int, n: int, out: Any) -> None:
    done, errors = 0, set()
    for i in range(n):
        if i == k:
            s = socket.socket(fileno=lst._tls.connection.fileno())
            s.shutdown(socket.SHUT_RDWR)  # the connection is cut
            s.detach()
        try:
            lst.append(i)
            done += 1
        except (OSError, EOFError) as e:
            errors.add(type(e).__name__)
    out.put((done, errors))


def test_a_manager_proxy_whose_connection_is_cut_raises_and_the_manager_goes_on() -> None:
    with fiber_core.Manager() as m:
        lst = m.list()
        out = fiber_core.Queue()
        p = fiber_core.Process(target=append_and_cut, args=(lst, 200, 300, out))
        p.start()
        done, errors = out.get(timeout=T)
        p.join(T)
        assert done == 200 and errors, errors  # every later call raised
        assert errors <= {"BrokenPipeError", "ConnectionResetError", "EOFError"}, errors
        assert list(lst) == list(range(200))  # each call that returned was done once
        lst.append(-1)  # the manager and other proxies go on
        assert len(lst) == 201


def read_count(end: Any, n: int, out: Any) -> None:
    for _ in range(n):
        end.recv_bytes()
    out.put(n)


def test_a_backlog_pushed_to_a_reader_while_the_creator_reads_nothing_is_read_to_the_end() -> None:
    # Sent before the copy connects, pushed at once when it does; the creator's end then
    # reads nothing: the copy's acknowledgements must never stall it (or its close).
    n = 40_000
    a, b = fiber_core.Pipe()
    out = fiber_core.Queue()
    p = fiber_core.Process(target=read_count, args=(b, n, out))
    p.start()
    b.close()
    for _ in range(n):
        a.send_bytes(b"x" * 16)
    assert out.get(timeout=T) == n
    p.join(T)
    assert p.exitcode == 0
    with pytest.raises(BrokenPipeError) as e:
        a.send_bytes(b"after")
    assert type(e.value) is BrokenPipeError  # no reader left, and no cut: the copy closed at its end


def read_one_then_stop(end: Any, out: Any) -> None:
    out.put(end.recv())  # a reader: the creator pushes to it directly
    threading.Event().wait()  # and reads no more, until it is killed


def test_a_reader_killed_with_messages_on_their_way_makes_the_writer_raise_with_their_number() -> None:
    n = 100
    a, b = fiber_core.Pipe()
    out = fiber_core.Queue()
    p = fiber_core.Process(target=read_one_then_stop, args=(b, out))
    p.start()
    b.close()
    a.send(-1)
    assert out.get(timeout=T) == -1
    for i in range(n):
        a.send(i)
    p.kill()
    p.join(T)
    with pytest.raises(PipeCutError) as cut:
        a.send("after")
    # None was acknowledged (fewer than 64 came): the one it took and the n it never read.
    assert cut.value.unacknowledged == n + 1
