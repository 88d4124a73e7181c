"""The creator's Pipe state machine (processes/pipe_machine.py), fed events by hand: no sockets."""

from __future__ import annotations

import pytest

from fiber_core.processes.pipe_machine import (
    BELL,
    WAIT,
    Closed,
    Control,
    Copy,
    Cut,
    Data,
    Handoff,
    Output,
    PipeMachine,
    Wake,
)
from fiber_core.wire.control import ACK, U64, control_frame
from fiber_core.wire.messages import (
    PIPE_ABANDON,
    PIPE_ACK,
    PIPE_ACTIVE,
    PIPE_BYE,
    PIPE_CLOSE,
    PIPE_CLOSED,
    PIPE_CLOSING,
    PIPE_EOF,
    PIPE_MODE,
    PIPE_RETURN,
    PIPE_TICKET,
    PIPE_WANT,
)


def ctrl(kind: bytes, body: bytes = b"") -> bytes:
    """A control frame's body as the machine receives it (the kind byte and fields)."""
    return control_frame(kind, body)[4:]


def frames(outs: list[Output], copy: Copy) -> list[bytes]:
    """The control kinds (and MODE's letter) sent to ``copy``, in order."""
    kinds = []
    for o in outs:
        if isinstance(o, Control) and o.copy is copy:
            body = o.frame[4:]
            kinds.append(body if body[:1] == PIPE_MODE else body[:1])
    return kinds


def messages(outs: list[Output], copy: Copy) -> list[tuple[bytes, bool]]:
    return [(o.message, o.pushed) for o in outs if isinstance(o, Data) and o.copy is copy]


def machine_with_local_end(i: int = 0, duplex: bool = True) -> PipeMachine:
    m = PipeMachine(duplex)
    m.opened(0)
    m.opened(1)
    return m


def connect(m: PipeMachine, end: int, copy_id: str, *, active: bool = False) -> tuple[Copy, list[Output]]:
    """A copy of ``end`` pickled by the creator connects (and is used, with ``active``)."""
    ticket = m.new_ticket(end)
    r, outs = m.connected(end, copy_id, ticket)
    if active:
        outs += m.control(r, ctrl(PIPE_ACTIVE))
    return r, outs


# -- mode ------------------------------------------------------------------------------------


def test_one_end_here_and_one_copy_there_talk_directly_and_the_end_reads_its_socket() -> None:
    m = machine_with_local_end()
    m.closed(1)  # the other end was sent to a worker and closed here, as programs do
    m.activate(0)
    r, outs = connect(m, 1, "w1", active=True)
    assert m.direct is r and m.reader[0] is r and r.local_reader
    assert frames(outs, r) == [PIPE_MODE + b"d"]
    assert any(isinstance(o, Handoff) and o.copy is r for o in outs)


def test_a_second_active_copy_ends_direct_mode_and_the_first_is_told_to_ask() -> None:
    m = machine_with_local_end()
    m.closed(1)
    m.activate(0)
    a, _ = connect(m, 1, "a", active=True)
    b, outs = connect(m, 1, "b", active=True)
    assert m.direct is None and m.reader == [None, None] and not a.local_reader
    assert frames(outs, a) == [PIPE_MODE + b"s"]
    assert frames(outs, b) == [PIPE_MODE + b"s"]
    assert any(isinstance(o, Handoff) and o.copy is a for o in outs)  # the relay reads it again


def test_entering_direct_mode_first_sends_what_was_queued_in_order() -> None:
    m = machine_with_local_end()
    m.closed(1)
    m.activate(0)
    r, _ = connect(m, 1, "w1")  # connected, not used yet: messages are queued for it
    m.send(0, b"one")
    m.send(0, b"two")
    assert list(m.fifo[1]) == [b"one", b"two"]
    outs = m.control(r, ctrl(PIPE_ACTIVE))
    assert frames(outs, r) == [PIPE_MODE + b"d"]
    assert messages(outs, r) == [(b"one", True), (b"two", True)]
    assert not m.fifo[1]
    assert messages(m.send(0, b"three"), r) == [(b"three", True)]


# -- queued mode: wants, retained messages, closing --------------------------------------------


def two_readers() -> tuple[PipeMachine, Copy, Copy]:
    m = machine_with_local_end()
    m.closed(1)
    m.activate(0)
    a, _ = connect(m, 1, "a", active=True)
    b, _ = connect(m, 1, "b", active=True)
    return m, a, b


def test_queued_messages_go_one_per_want_in_order_to_whoever_asked() -> None:
    m, a, b = two_readers()
    for msg in (b"1", b"2", b"3"):
        assert m.send(0, msg) == []  # nobody asked yet: queued
    outs = m.control(a, ctrl(PIPE_WANT, U64.pack(0)))
    outs += m.control(b, ctrl(PIPE_WANT, U64.pack(0)))
    assert messages(outs, a) == [(b"1", False)]
    assert messages(outs, b) == [(b"2", False)]
    assert list(m.fifo[1]) == [b"3"]
    assert messages(m.control(a, ctrl(PIPE_WANT, U64.pack(1))), a) == [(b"3", False)]
    assert list(a.retained) == [b"3"]  # "1" was reported taken, "3" not yet


def test_a_message_a_reader_acknowledged_taking_is_not_handed_out_again_when_it_is_lost() -> None:
    m, a, b = two_readers()
    m.send(0, b"1")
    m.send(0, b"2")
    m.control(a, ctrl(PIPE_WANT, U64.pack(0)))  # a is handed "1" ...
    m.control(a, ctrl(PIPE_ACK, ACK.pack(0, 1)))  # ... and took it
    assert not a.retained
    m.control(a, ctrl(PIPE_WANT, U64.pack(1)))  # a is handed "2", which it never gets
    outs = m.lost(a)  # its connection was cut
    assert Cut(a, 0, 0) in outs  # nothing was pushed to it: nothing may be lost
    assert messages(outs, b) == [(b"2", True)]  # to the one reader left, which now reads directly


def test_a_lost_reader_reports_what_it_acknowledged_and_what_no_reader_is_left_to_take() -> None:
    m = machine_with_local_end()
    m.closed(1)
    m.activate(0)
    r, _ = connect(m, 1, "w1", active=True)
    m.control(r, ctrl(PIPE_ACK, ACK.pack(64, 0)))
    m.control(r, ctrl(PIPE_ACK, ACK.pack(3, 0)))  # cumulative: an older count changes nothing
    assert r.acked == 64
    m.failed(r, [b"unsent"])  # a push failed: it goes back to the queue, with no reader left
    outs = m.lost(r)
    assert Cut(r, 64, 1) in outs and not m.fifo[1]
    assert m.lost(r) == []  # reported once


def test_a_reader_that_closes_gives_back_what_it_did_not_take_in_front_and_in_order() -> None:
    m, a, b = two_readers()
    c, _ = connect(m, 1, "c", active=True)  # a third reader: the pipe stays queued
    m.send(0, b"1")
    m.send(0, b"2")
    m.control(a, ctrl(PIPE_WANT, U64.pack(0)))  # a is handed "1"
    outs = m.control(a, ctrl(PIPE_CLOSING, U64.pack(0)))  # ... and did not take it
    assert frames(outs, a) == [PIPE_CLOSED]
    m.control(a, ctrl(PIPE_RETURN, b"0"))  # a message it had been sent directly, earlier
    outs = m.control(a, ctrl(PIPE_CLOSE, U64.pack(0)))
    assert frames(outs, a) == [PIPE_BYE]
    assert list(m.fifo[1]) == [b"0", b"1", b"2"]
    assert messages(m.control(b, ctrl(PIPE_WANT, U64.pack(0))), b) == [(b"0", False)]


def test_what_a_closing_reader_gives_back_goes_to_the_one_reader_left_that_reads_directly() -> None:
    m, a, b = two_readers()
    m.send(0, b"1")
    m.control(a, ctrl(PIPE_WANT, U64.pack(0)))  # a is handed "1" and does not take it
    outs = m.control(a, ctrl(PIPE_CLOSING, U64.pack(0)))
    assert m.direct is b and frames(outs, b) == [PIPE_MODE + b"d"]
    outs = m.control(a, ctrl(PIPE_CLOSE, U64.pack(0)))
    assert messages(outs, b) == [(b"1", True)]
    assert not m.fifo[1]


def test_a_copy_that_closes_with_fewer_messages_than_were_pushed_to_it_is_reported() -> None:
    m = machine_with_local_end()
    m.closed(1)
    m.activate(0)
    r, _ = connect(m, 1, "w1", active=True)
    connect(m, 1, "spare")  # another holder: a reader remains, so the loss matters
    outs = m.control(r, ctrl(PIPE_CLOSE, U64.pack(3)))
    assert Closed(r, 3) in outs


def test_a_failed_send_puts_the_message_back_in_front_and_leaves_direct_mode() -> None:
    m = machine_with_local_end()
    m.closed(1)
    m.activate(0)
    r, _ = connect(m, 1, "w1", active=True)
    connect(m, 1, "other")
    m.fifo[1].append(b"later")
    outs = m.failed(r, [b"lost"])
    assert r.closing and m.direct is None
    assert list(m.fifo[1]) == [b"lost", b"later"]
    assert frames(outs, r) == []  # a broken copy is sent nothing more


# -- holders, tickets, end of file ---------------------------------------------------------------


def test_a_copy_on_its_way_is_a_holder_until_abandoned_then_readers_get_eof() -> None:
    m = machine_with_local_end()
    m.activate(0)
    ticket = m.new_ticket(1)  # end 1 pickled for a process ...
    m.closed(1)  # ... and closed here
    assert not m.eof(0)
    r, _ = connect(m, 0, "reader")  # a copy of end 0 elsewhere, not used yet
    m.control(r, ctrl(PIPE_ACTIVE))
    m.closed(0)
    assert m.control(r, ctrl(PIPE_WANT, U64.pack(0))) == []  # it waits: a writer is on its way
    outs = m.abandon(ticket)  # ... which will never arrive
    assert frames(outs, r) == [PIPE_EOF]
    assert m.eof(0)


def test_writing_with_no_reader_left_is_a_broken_pipe_and_changes_nothing() -> None:
    m = machine_with_local_end()
    m.activate(0)
    m.closed(1)
    with pytest.raises(BrokenPipeError):
        m.send(0, b"x")
    assert not m.fifo[1]


def test_what_a_copy_passed_on_writes_waits_for_what_its_sender_wrote_before() -> None:
    m = machine_with_local_end()
    a, _ = connect(m, 1, "a")
    b, _ = m.connected(1, "b", "a.1")  # a's copy arrived before a's TICKET was read
    assert not m.may_queue(b)
    m.control(a, ctrl(PIPE_TICKET, b"a.1"))
    assert m.may_queue(b)


def test_what_a_copy_writes_is_queued_at_once_when_its_sender_is_gone() -> None:
    m = machine_with_local_end()
    a, _ = connect(m, 1, "a")
    b, _ = m.connected(1, "b", "a.1")
    m.control(a, ctrl(PIPE_ABANDON, b"a.9"))  # an unrelated ticket: still waits
    assert not m.may_queue(b)
    m.lost(a)
    assert m.may_queue(b)


def test_a_message_for_an_end_read_here_wakes_its_socket_reader_to_read_the_queue_first() -> None:
    m = machine_with_local_end()
    m.closed(1)
    m.activate(0)
    r, _ = connect(m, 1, "w1", active=True)
    other, _ = connect(m, 1, "w2")  # holds end 1 too, not used
    outs = m.data(other, b"from w2")  # w2's message comes through the creator
    assert list(m.fifo[0]) == [b"from w2"]
    assert Wake(r) in outs
    assert m.ready(0)
    assert m.take(0) == b"from w2"


# -- fileno ----------------------------------------------------------------------------------------


def test_fileno_waits_for_the_one_copy_on_its_way_then_is_its_socket() -> None:
    m = machine_with_local_end()
    m.closed(1)
    m.activate(0)
    ticket = m.new_ticket(1)
    _, answer = m.fileno(0)
    assert answer == WAIT
    r, _ = m.connected(1, "w1", ticket)  # not used yet: fileno() pairs early
    _, answer = m.fileno(0)
    assert answer is r and m.direct is r


def test_fileno_with_several_copies_of_the_other_end_is_the_bell() -> None:
    m = machine_with_local_end()
    m.closed(1)
    m.activate(0)
    connect(m, 1, "a")
    connect(m, 1, "b")
    _, answer = m.fileno(0)
    assert answer == BELL
