"""The creator's side of a Pipe as a state machine: copies, mode, queues and tickets; no I/O.

:class:`PipeMachine` is what the process that called ``Pipe()`` knows of the pipe:
which copies of each end exist (its own ends, copies that connected back, copies
pickled and on their way: *tickets*), which messages wait for a reader of each end
(a FIFO per end), which remote readers asked for one, what each was handed and has
not yet reported taken, and the *mode*: direct (the creator's one active end talks
to the one active copy of the other end on its connection) or queued (every message
goes through the creator's FIFOs, and a remote reader asks for each with
``PIPE_WANT``).

It is fed events (a local end opened, used, closed or written; a copy connected,
sent a control frame or a message, was lost) and answers with what to do: control
frames and messages to send to copies, hand-offs of a copy's socket between the
creator's end and the relay thread, wake-ups. It sends nothing, reads no socket,
takes no lock and looks at no clock: ``processes/pipe_creator.py`` calls it under the
pipe's lock and carries its answers out, in order; a send that fails comes back
as :meth:`PipeMachine.failed`.
"""

from __future__ import annotations

import errno
from collections import deque
from typing import Any, NamedTuple

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

CREATOR = "c"  # the copy id that issues the creator's own tickets

_MODE_DIRECT = control_frame(PIPE_MODE, b"d")
_MODE_QUEUED = control_frame(PIPE_MODE, b"s")
_EOF = control_frame(PIPE_EOF)
_CLOSED = control_frame(PIPE_CLOSED)
_BYE = control_frame(PIPE_BYE)


class Copy:
    """The machine's record of one copy of an end that another process holds."""

    __slots__ = ("end", "id", "ticket", "issuer", "registered", "active", "closing", "gone",
                 "local_reader", "retained", "taken", "acked", "returns", "eof_sent", "io")

    def __init__(self, end: int, copy_id: str, ticket: str, io: Any = None) -> None:
        self.end = end
        self.id = copy_id
        self.ticket = ticket
        self.issuer = ticket.split(".", 1)[0]
        self.registered = False  # its issuer's TICKET was read: what the issuer wrote before is queued
        self.active = False
        self.closing = False  # it said it closes (or a send to it failed): send it nothing more
        self.gone = False
        self.local_reader = False  # the creator's end reads its socket (else the relay thread)
        self.retained: deque[bytes] = deque()  # handed over on its WANTs, not yet reported taken
        self.taken = 0  # messages it reported taken
        self.acked = 0  # pushed messages it acknowledged (PIPE_ACK's received)
        self.returns: list[bytes] = []  # messages sent to it directly that it gave back
        self.eof_sent = False
        self.io = io  # the connection's record of whoever carries out the answers

    def __repr__(self) -> str:
        return f"<Copy {self.id} of end {self.end}>"


class Control(NamedTuple):
    """Send ``frame`` (a control frame) to ``copy``."""

    copy: Copy
    frame: bytes


class Data(NamedTuple):
    """Send ``message`` to ``copy``: unasked (``pushed``, direct mode) or on its WANT."""

    copy: Copy
    message: bytes
    pushed: bool


class Handoff(NamedTuple):
    """Who reads ``copy``'s socket changed (``copy.local_reader``): wake its reader."""

    copy: Copy


class Wake(NamedTuple):
    """The creator's end that reads ``copy``'s socket must look at its FIFO first."""

    copy: Copy


class Closed(NamedTuple):
    """``copy`` closed having received ``received`` pushed messages, and other readers
    remain: if more were pushed to it, they were lost on the way."""

    copy: Copy
    received: int


class Cut(NamedTuple):
    """``copy``'s connection ended without it closing (its process ended, or the connection
    was cut): the messages pushed to it beyond the ``acked`` it acknowledged may be lost, and
    the ``dropped`` that waited for a reader of its end, none being left, are."""

    copy: Copy
    acked: int
    dropped: int


Output = Control | Data | Handoff | Wake | Closed | Cut

WAIT = "wait"  # fileno(): the one copy of the other end is on its way
BELL = "bell"  # fileno(): a descriptor of the creator's that rings when a message is here


class PipeMachine:
    """The creator's state of one Pipe; see the module's docstring."""

    def __init__(self, duplex: bool) -> None:
        self.duplex = duplex
        self.local_open = [0, 0]  # the creator's open ends, per end
        self.local_active = [False, False]
        self.eager = [False, False]  # fileno() was asked of the local end: pair early
        self.tickets: dict[str, int] = {}  # pickled copies on their way -> end
        self.early: dict[str, Copy] = {}  # arrived before its issuer's TICKET was read
        self.copies: dict[str, Copy] = {}  # copy id -> record
        self.fifo: list[deque[bytes]] = [deque(), deque()]  # messages to be read on end i
        self.waiting: list[deque[Copy]] = [deque(), deque()]  # remote readers that asked
        self.direct: Copy | None = None
        self.reader: list[Copy | None] = [None, None]  # the copy whose socket end i reads
        self.serial = 0
        self._out: list[Output] = []

    def _answer(self) -> list[Output]:
        out, self._out = self._out, []
        return out

    # -- counting ------------------------------------------------------------------------

    def readable(self, i: int) -> bool:
        return self.duplex or i == 0

    def holders(self, i: int) -> int:
        """Copies of end ``i`` that exist or are on their way (the writers to ``1 - i``)."""
        return (self.local_open[i] + sum(1 for e in self.tickets.values() if e == i)
                + sum(1 for r in self.copies.values() if r.end == i))

    def has_reader(self, i: int) -> bool:
        """Whether a copy of end ``i`` can still take a message."""
        if self.local_open[i]:
            return True
        for r in self.copies.values():
            if r.end == i and not r.closing:
                return True
        return i in self.tickets.values()

    def eof(self, i: int) -> bool:
        return not self.fifo[i] and self.holders(1 - i) == 0

    def ready(self, i: int) -> bool:
        """Whether a reader of end ``i`` here would not wait (a message, or the end)."""
        return bool(self.fifo[i]) or (self.readable(i) and self.eof(i))

    # -- the creator's own ends ------------------------------------------------------------

    def opened(self, i: int) -> None:
        self.local_open[i] += 1

    def activate(self, i: int) -> list[Output]:
        if not self.local_active[i]:
            self.local_active[i] = True
            self._update()
        return self._answer()

    def closed(self, i: int) -> list[Output]:
        self.local_open[i] -= 1
        if self.local_open[i] == 0:
            self.local_active[i] = False
        self._update()
        return self._answer()

    def send(self, i: int, msg: bytes) -> list[Output]:
        """The creator's end ``i`` (activated) writes ``msg``; ``BrokenPipeError``, and
        nothing changed, if no reader of the other end is left."""
        if not self.has_reader(1 - i):
            raise BrokenPipeError(errno.EPIPE, "no process holds the other end of this Pipe")
        self._deliver(1 - i, msg)
        return self._answer()

    def take(self, i: int) -> bytes:
        """The next queued message for the creator's end ``i`` (``fifo[i]`` is not empty)."""
        return self.fifo[i].popleft()

    def fileno(self, i: int) -> tuple[list[Output], Copy | str]:
        """What ``fileno()`` of the creator's end ``i`` returns: the socket of the copy it
        talks to directly (a :class:`Copy`), :data:`WAIT` or :data:`BELL`."""
        self.eager[i] = True
        self._update()
        j = 1 - i
        r = self.direct
        if r is not None and r.end == j:
            return self._answer(), r if r.local_reader else BELL
        on_way = [e for e in self.tickets.values() if e == j]
        if (len(on_way) == 1 and not any(c.end == j for c in self.copies.values())
                and not (self.local_open[j] and self.local_active[j])):
            return self._answer(), WAIT  # until that copy connects, or its process ends
        return self._answer(), BELL

    def new_ticket(self, i: int) -> str:
        """A ticket for a copy of end ``i`` that the creator pickles now."""
        self.serial += 1
        ticket = f"{CREATOR}.{self.serial}"
        self.tickets[ticket] = i
        return ticket

    def abandon(self, ticket: str) -> list[Output]:
        """That pickled copy will never arrive (or came back to the creator)."""
        if self.tickets.pop(ticket, None) is not None:
            self._update()
        return self._answer()

    # -- copies held elsewhere ---------------------------------------------------------------

    def connected(self, end: int, copy_id: str, ticket: str, io: Any = None) -> tuple[Copy, list[Output]]:
        """A copy of ``end`` with ``ticket`` connected; ``io`` is kept as its ``io``."""
        r = Copy(end, copy_id, ticket, io)
        if self.tickets.pop(ticket, None) is not None or r.issuer == CREATOR \
                or r.issuer not in self.copies:
            r.registered = True
        else:
            self.early[ticket] = r
        self.copies[copy_id] = r
        self._update()
        return r, self._answer()

    def may_queue(self, r: Copy) -> bool:
        """Whether a message ``r`` wrote can be queued now: after what its issuer wrote
        before pickling it (the issuer's TICKET was read), or its issuer is gone."""
        if r.registered or r.gone:
            return True
        if r.issuer not in self.copies:
            self._register(r.ticket)
            return True
        return False

    def data(self, r: Copy, msg: bytes) -> list[Output]:
        """``r`` wrote ``msg`` (``may_queue(r)`` said yes)."""
        i = 1 - r.end
        if self.has_reader(i):
            self._deliver(i, msg)
        return self._answer()

    def control(self, r: Copy, body: bytes) -> list[Output]:
        """A control frame from ``r``: its kind byte and fields."""
        kind = body[:1]
        if kind == PIPE_WANT:
            self._want(r, U64.unpack_from(body, 1)[0])
        elif kind == PIPE_ACK:
            received, taken = ACK.unpack_from(body, 1)
            r.acked = max(r.acked, received)
            self._settle(r, taken)  # a message it took is its own: never handed out again
        elif kind == PIPE_ACTIVE:
            r.active = True
            self._update()
            if self.direct is not r:
                self._out.append(Control(r, _MODE_QUEUED))
        elif kind == PIPE_TICKET:
            ticket = body[1:].decode()
            if ticket in self.early:
                self._register(ticket)
            else:
                self.tickets[ticket] = r.end
        elif kind == PIPE_ABANDON:
            return self.abandon(body[1:].decode())
        elif kind == PIPE_RETURN:
            r.returns.append(body[1:])
        elif kind == PIPE_CLOSING:
            self._settle(r, U64.unpack_from(body, 1)[0])
            r.closing = True
            if r in self.waiting[r.end]:
                self.waiting[r.end].remove(r)
            self._update()
            self._out.append(Control(r, _CLOSED))
        elif kind == PIPE_CLOSE:
            self._remove(r, U64.unpack_from(body, 1)[0])
            self._out.append(Control(r, _BYE))
        return self._answer()

    def lost(self, r: Copy) -> list[Output]:
        """``r``'s connection ended (its process ended, or its socket failed) before it closed."""
        if r.gone:
            return []
        self._remove(r, None)
        fifo = self.fifo[r.end]
        dropped = 0 if self.has_reader(r.end) else len(fifo)
        if dropped:
            fifo.clear()
        self._out.append(Cut(r, r.acked, dropped))
        return self._answer()

    def unsettled(self, i: int) -> bool:
        """Whether a copy of end ``i`` that may not take messages anymore has not ended yet."""
        return any(r.end == i and r.closing and not r.gone for r in self.copies.values())

    def failed(self, r: Copy, unsent: list[bytes]) -> list[Output]:
        """A send to ``r`` failed; ``unsent`` are the messages of the answer it did not get."""
        r.closing = True
        for msg in unsent:
            for k in range(len(r.retained) - 1, -1, -1):
                if r.retained[k] is msg:
                    del r.retained[k]
                    break
        if unsent:
            self._back_in_front(r.end, unsent)
        self._update()
        return self._answer()

    # -- what the events do ----------------------------------------------------------------

    def _want(self, r: Copy, taken: int) -> None:
        self._settle(r, taken)
        if self.direct is r or r.closing:
            return
        i = r.end
        if self.fifo[i]:
            self.waiting[i].append(r)
            self._serve_waiting(i)
        elif self.eof(i):
            self._out.append(Control(r, _EOF))
        else:
            self.waiting[i].append(r)

    def _update(self) -> None:
        """Choose direct or queued mode for what is active now."""
        act_local = [i for i in (0, 1) if self.local_open[i] and self.local_active[i]]
        act_remote = [r for r in self.copies.values() if r.active and not r.closing]
        target = None
        if len(act_local) == 1 and len(act_remote) == 1 and act_remote[0].end != act_local[0]:
            target = act_remote[0]
        elif len(act_local) == 1 and not act_remote and self.eager[act_local[0]]:
            # Its descriptor was asked for: pair with the one copy of the other end, unused yet.
            x = act_local[0]
            others = [r for r in self.copies.values() if r.end != x and not r.closing]
            if len(others) == 1 and all(e == x for e in self.tickets.values()):
                target = others[0]
        if self.direct is not None and self.direct is not target:
            self._leave_direct()
        if target is not None and self.direct is None:
            self._enter_direct(target)
        self._check_eof()

    def _enter_direct(self, r: Copy) -> None:
        x = 1 - r.end
        if r in self.waiting[r.end]:
            self.waiting[r.end].remove(r)
        self._out.append(Control(r, _MODE_DIRECT))
        fifo = self.fifo[r.end]
        while fifo:
            self._out.append(Data(r, fifo.popleft(), True))
        self.direct = r
        if self.readable(x):
            r.local_reader = True
            self.reader[x] = r
            self._out.append(Handoff(r))

    def _leave_direct(self) -> None:
        r = self.direct
        assert r is not None
        self.direct = None
        if r.gone:
            return
        if not r.closing:
            self._out.append(Control(r, _MODE_QUEUED))
        if r.local_reader:
            r.local_reader = False
            self.reader = [None, None]
            self._out.append(Handoff(r))

    def _check_eof(self) -> None:
        for i in (0, 1):
            if not self.readable(i) or not self.eof(i):
                continue
            while self.waiting[i]:
                self._out.append(Control(self.waiting[i].popleft(), _EOF))
            r = self.direct
            if r is not None and r.end == i and not r.eof_sent:
                r.eof_sent = True
                self._out.append(Control(r, _EOF))

    def _deliver(self, i: int, msg: bytes) -> None:
        """Give ``msg`` to a reader of end ``i``."""
        r = self.direct
        if r is not None and r.end == i and not r.closing:
            self._out.append(Data(r, msg, True))
            return
        while self.waiting[i]:
            w = self.waiting[i].popleft()
            if w.closing:
                continue
            w.retained.append(msg)
            self._out.append(Data(w, msg, False))
            return
        self.fifo[i].append(msg)
        self._wake_local_reader(i)

    def _wake_local_reader(self, i: int) -> None:
        r = self.direct
        if r is not None and r.end == 1 - i and r.local_reader:
            self._out.append(Wake(r))  # the local reader of end i reads the FIFO before the socket

    def _serve_waiting(self, i: int) -> None:
        while self.waiting[i] and self.fifo[i]:
            w = self.waiting[i].popleft()
            if w.closing:
                continue
            msg = self.fifo[i].popleft()
            w.retained.append(msg)
            self._out.append(Data(w, msg, False))

    def _settle(self, r: Copy, taken: int) -> None:
        while r.taken < taken and r.retained:
            r.retained.popleft()
            r.taken += 1
        r.taken = max(r.taken, taken)

    def _back_in_front(self, i: int, msgs: list[bytes]) -> None:
        d = self.direct
        if d is not None and d.end == i and not d.closing:
            # The one reader of end i reads its socket, not the FIFO: they go to it.
            self._out.extend(Data(d, msg, True) for msg in msgs)
            return
        self.fifo[i].extendleft(reversed(msgs))
        self._serve_waiting(i)
        self._wake_local_reader(i)

    def _remove(self, r: Copy, received: int | None) -> None:
        """``r`` is closed or its process ended."""
        if r.gone:
            return
        r.gone = True
        r.closing = True
        self.reader = [x if x is not r else None for x in self.reader]
        self.copies.pop(r.id, None)
        if r in self.waiting[r.end]:
            self.waiting[r.end].remove(r)
        back = r.returns + list(r.retained)  # what it was given and did not take
        r.returns = []
        r.retained.clear()
        if back:
            self._back_in_front(r.end, back)
        if received is not None and self.has_reader(r.end):
            self._out.append(Closed(r, received))
        for g in list(self.early.values()):
            if g.issuer == r.id:
                self._register(g.ticket)
        self._update()

    def _register(self, ticket: str) -> None:
        g = self.early.pop(ticket, None)
        if g is not None:
            g.registered = True
