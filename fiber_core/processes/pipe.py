"""``Pipe``: two connected ends that any processes of a run can hold, like the stdlib's handles.

Semantics (those of :func:`multiprocessing.Pipe`'s duplicated file descriptors):

* Sending an end to another process (as a Process argument, through a Queue or
  another Pipe) gives that process a *copy*; the sender's copy stays usable, and
  the receiver may pass it on again, before or after it used it.
* Every message written on either end by any holder arrives; holders reading
  the same end share its messages, each delivered once. Messages from one
  holder arrive in the order it wrote them, and a copy passed on is written to
  only after what its sender wrote before passing it.
* A copy that a process closes (or drops, or never uses) changes nothing for
  the others. A reader gets ``EOFError`` once every holder of the other end has
  closed its copy or ended, and it has read what they wrote; writing when no
  holder of the other end is left raises ``BrokenPipeError``.

How. The process that called ``Pipe()`` (the *creator*) keeps the pipe's state:
which copies exist (its own, those that connected back, those on their way),
and a FIFO of messages per direction. Every copy held elsewhere connects to the
creator when it arrives. A copy is *active* once it is used (sent on, received
on, polled, or asked for its ``fileno()``); an unused copy only counts as a
holder. When exactly two copies are active, one in the creator and one of the
other end elsewhere (a parent and its worker: the usual case), the creator
talks to that copy directly on its connection: the creator's end reads and
writes that socket itself, with no thread in between. Otherwise messages go
through the creator: it reads every active copy's connection, queues what they
write, and hands each message to one reader, in order; a remote reader asks for
each message, and the creator keeps what it handed over until the reader says it
took it. The mode changes as copies become active or close, at message
boundaries, without losing or reordering messages.

Where the stdlib differs: a message that reached a process belongs to that
process's copy. A reader that polled a message in (``poll()`` asks the creator
for one when messages go through it), or had it sent directly, reads it or gives
it back to the others when it closes the copy or exits; a copy in a process
that is killed takes such messages with it (a message it polled but did not take
is given to another reader again). A remote writer whose readers are all gone
drops what it writes (the creator cannot make its ``send`` fail). A pipe works
as long as its creator runs. ``fileno()`` of a copy is a descriptor that becomes
readable when a message (or the end of the pipe) is there, for
:func:`fiber_core.connection.wait`; it may also wake when the pipe changes mode.

Messages between a copy and the creator: data frames (the program's messages)
and control frames on one connection, both read and written by
``wire/control.py``; the control kinds (``PIPE_*``) are defined, with the run's
others, in ``fiber_core/wire/messages.py``.

A copy connects to the creator's hub with the target
``pipe:<pipe id>:<end>:<ticket>:<copy id>``; a ticket is ``<issuer copy id>.<n>``
(the creator's copy id is ``c``).
"""

from __future__ import annotations

import atexit
import errno
import os
import select
import socket
import struct
import sys
import threading
import time
import weakref
from collections import deque
from typing import Any

from fiber_core.base.errors import PicklingError
from fiber_core.base.log import log
from fiber_core.processes.process import pickling_for
from fiber_core.runtime.hub import dial
from fiber_core.runtime.run import outgoing_addresses, runtime
from fiber_core.wire.control import U64, control_frame, peek_is_data, read_frame, send_data
from fiber_core.wire.framing import Connection
from fiber_core.wire.messages import (
    PIPE_ABANDON,
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

_SWITCHED = object()  # a local read stopped because the pipe changed mode

_WAIT = struct.pack("ll", 0, 50_000)  # SO_RCVTIMEO of a copy's socket in the creator: 50 ms


# -- waiting -----------------------------------------------------------------------------


def _wait_readable(fds: list[int], deadline: float | None) -> list[int]:
    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    ms = None if timeout is None else int(timeout * 1000 + 0.999)
    return [fd for fd, _ in poller.poll(ms)]


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + max(0.0, timeout)


# -- the creator's side ------------------------------------------------------------------


class _Bell:
    """A descriptor that is readable while a local end has something to read."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        self.on = False

    def set(self, on: bool) -> None:
        if on and not self.on:
            os.write(self.w, b"x")
        elif self.on and not on:
            try:
                os.read(self.r, 64)
            except BlockingIOError:
                pass
        self.on = on


class _Remote:
    """The creator's record of one copy of an end that another process holds."""

    def __init__(self, end: int, sock: socket.socket, copy_id: str, ticket: str) -> None:
        self.end = end
        self.sock = sock
        self.copy_id = copy_id
        self.issuer = ticket.split(".", 1)[0]
        self.ticket = ticket
        self.registered = False  # its issuer's TICKET was read: what the issuer wrote before is queued
        self.wlock = threading.Lock()  # one writer of frames at a time
        self.rlock = threading.Lock()  # one reader of the socket at a time
        self.owner = "relay"  # who reads the socket: "relay" (a thread) or "local" (the creator's end)
        self.relay_running = True
        self.wake_r, self.wake_w = os.pipe()  # readable: the reader must look at ``owner`` again
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _WAIT)
        self.poller = select.poll()  # used by the holder of ``rlock``
        self.poller.register(sock.fileno(), select.POLLIN)
        self.poller.register(self.wake_r, select.POLLIN)
        self.active = False
        self.closing = False  # it said it closes (or its socket failed): send it nothing more
        self.gone = False
        self.retained: deque[bytes] = deque()  # sent on its WANTs, not yet reported taken
        self.taken = 0  # messages it reported taken
        self.pulled = 0  # messages sent on its WANTs
        self.pushed = 0  # messages sent to it directly
        self.returns: list[bytes] = []
        self.eof_sent = False

    def wake(self) -> None:
        if self.wake_w >= 0:
            try:
                os.write(self.wake_w, b"x")
            except OSError:
                pass

    def wait(self, deadline: float | None) -> tuple[bool, bool]:
        """Wait (``rlock`` held) until the socket or the wake-up is readable: (socket, wake-up)."""
        if deadline is None:
            ms = None
        else:
            ms = max(0, int((deadline - time.monotonic()) * 1000 + 0.999))
        sock_ready = wake = False
        for fd, _ in self.poller.poll(ms):
            if fd == self.wake_r:
                wake = True
            else:
                sock_ready = True
        return sock_ready, wake

    def drain_wake(self) -> None:
        try:
            while os.read(self.wake_r, 64):
                pass
        except OSError:
            pass

    def send_ctrl(self, kind: bytes, body: bytes = b"") -> bool:
        """Send a control frame (``wlock`` held by the caller or not needed)."""
        try:
            self.sock.sendall(control_frame(kind, body))
            return True
        except OSError:
            self.closing = True
            return False

    def close_fds(self) -> None:
        """Release the descriptors of a copy that is gone (the pipe's lock is held)."""
        fds, self.wake_r, self.wake_w = (self.wake_r, self.wake_w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        self.sock.close()


class _Pipe:
    """The creator's state of one Pipe: its copies, FIFOs, and how messages flow."""

    def __init__(self, pipe_id: str, duplex: bool) -> None:
        self.id = pipe_id
        self.duplex = duplex
        self.lock = threading.RLock()  # reentrant: a dropped end may close from the GC
        self.cond = threading.Condition(self.lock)
        self.local_open = [0, 0]  # the creator's open PipeEnd objects, per end
        self.local_active = [False, False]
        self.tickets: dict[str, int] = {}  # pickled copies on their way -> end
        self.early: dict[str, _Remote] = {}  # arrived before its issuer's TICKET was read
        self.remotes: dict[str, _Remote] = {}  # copy id -> record
        self.fifo: list[deque[bytes]] = [deque(), deque()]  # messages to be read on end i
        self.waiting: list[deque[_Remote]] = [deque(), deque()]  # remote readers that asked
        self.direct: _Remote | None = None
        self.reader: list[_Remote | None] = [None, None]  # the socket end i reads directly
        self.bells: list[_Bell | None] = [None, None]
        self.eager = [False, False]  # fileno() was asked of the local end: pair early
        self.serial = 0

    # -- counting (lock held) ------------------------------------------------------------

    def _readable(self, i: int) -> bool:
        return self.duplex or i == 0

    def holders(self, i: int) -> int:
        """Copies of end ``i`` that exist or are on their way (the writers to ``1 - i``)."""
        return (self.local_open[i] + sum(1 for e in self.tickets.values() if e == i)
                + sum(1 for r in self.remotes.values() if r.end == i))

    def readers(self, i: int) -> int:
        """Copies of end ``i`` that can still take a message."""
        return (self.local_open[i] + sum(1 for e in self.tickets.values() if e == i)
                + sum(1 for r in self.remotes.values() if r.end == i and not r.closing))

    def eof(self, i: int) -> bool:
        return not self.fifo[i] and self.holders(1 - i) == 0

    # -- mode ----------------------------------------------------------------------------

    def update(self) -> None:
        """Choose direct or queued mode for what is active now; wake whoever must know."""
        act_local = [i for i in (0, 1) if self.local_open[i] and self.local_active[i]]
        act_remote = [r for r in self.remotes.values() if r.active and not r.closing]
        target = None
        if len(act_local) == 1 and len(act_remote) == 1 and act_remote[0].end != act_local[0]:
            target = act_remote[0]
        elif len(act_local) == 1 and not act_remote and self.eager[act_local[0]]:
            # Its descriptor was asked for: pair with the one copy of the other end, unused yet.
            x = act_local[0]
            others = [r for r in self.remotes.values() if r.end != x and not r.closing]
            if len(others) == 1 and all(e == x for e in self.tickets.values()):
                target = others[0]
        if self.direct is not None and self.direct is not target:
            self._leave_direct()
        if target is not None and self.direct is None:
            self._enter_direct(target)
        self.check_eof()

    def _enter_direct(self, r: _Remote) -> None:
        x = 1 - r.end
        if r in self.waiting[r.end]:
            self.waiting[r.end].remove(r)
        with r.wlock:
            ok = r.send_ctrl(PIPE_MODE, b"d")
            fifo = self.fifo[r.end]
            try:
                while ok and fifo:
                    send_data(r.sock, fifo[0])
                    fifo.popleft()
                    r.pushed += 1
            except OSError:
                ok = False
        if not ok:
            r.closing = True
            return
        self.direct = r
        if self._readable(x):
            r.owner = "local"
            self.reader[x] = r
            r.wake()
        self.cond.notify_all()

    def _leave_direct(self) -> None:
        r = self.direct
        assert r is not None
        self.direct = None
        if not r.gone:
            if not r.closing:
                with r.wlock:
                    r.send_ctrl(PIPE_MODE, b"s")
            if r.owner == "local":
                r.owner = "relay"
                self.reader = [None, None]
                r.wake()
                if not r.relay_running:
                    r.relay_running = True
                    threading.Thread(target=self.relay, args=(r,), daemon=True,
                                     name="fiber-pipe-relay").start()
        self.cond.notify_all()

    def check_eof(self) -> None:
        for i in (0, 1):
            self.ring(i)
            if not self._readable(i) or not self.eof(i):
                continue
            self.cond.notify_all()
            while self.waiting[i]:
                w = self.waiting[i].popleft()
                with w.wlock:
                    w.send_ctrl(PIPE_EOF)
            r = self.direct
            if r is not None and r.end == i and not r.eof_sent:
                r.eof_sent = True
                with r.wlock:
                    r.send_ctrl(PIPE_EOF)

    def ring(self, i: int) -> None:
        bell = self.bells[i]
        if bell is not None:
            bell.set(bool(self.fifo[i]) or (self._readable(i) and self.eof(i)))

    def local_fileno(self, i: int) -> int:
        """A descriptor that is readable when end ``i`` has something to read.

        As with the stdlib, it is the connection's socket when this end talks to
        one copy of the other end directly (so ``multiprocessing.reduction`` can
        pass descriptors on it); if that copy is on its way, it waits for it.
        """
        self.activate(i)
        j = 1 - i
        with self.cond:
            self.eager[i] = True
            while True:
                self.update()
                r = self.direct
                if r is not None and r.end == j:
                    if r.owner == "local":
                        return r.sock.fileno()
                    break
                on_way = [e for e in self.tickets.values() if e == j]
                if (len(on_way) == 1 and not any(r.end == j for r in self.remotes.values())
                        and not (self.local_open[j] and self.local_active[j])):
                    self.cond.wait()  # until that copy connects, or its process ends
                    continue
                break
            return self.bell(i)

    def bell(self, i: int) -> int:
        with self.lock:
            if self.bells[i] is None:
                self.bells[i] = _Bell()
            self.ring(i)
            bell = self.bells[i]
            assert bell is not None
            return bell.r

    # -- messages --------------------------------------------------------------------------

    def deliver(self, i: int, msg: bytes) -> None:
        """Give ``msg`` to a reader of end ``i`` (lock held)."""
        r = self.direct
        if r is not None and r.end == i:
            with r.wlock:
                try:
                    send_data(r.sock, msg)
                    r.pushed += 1
                    return
                except OSError:
                    r.closing = True
            self.update()
        while self.waiting[i]:
            w = self.waiting[i].popleft()
            if w.closing:
                continue
            with w.wlock:
                try:
                    send_data(w.sock, msg)
                except OSError:
                    w.closing = True
                    continue
            w.retained.append(msg)
            w.pulled += 1
            return
        self.fifo[i].append(msg)
        self.cond.notify_all()
        self.ring(i)
        r = self.direct
        if r is not None and r.end == 1 - i:
            r.wake()  # the local reader of end i reads the FIFO before the socket

    def serve_waiting(self, i: int) -> None:
        while self.waiting[i] and self.fifo[i]:
            w = self.waiting[i].popleft()
            if w.closing:
                continue
            msg = self.fifo[i].popleft()
            with w.wlock:
                try:
                    send_data(w.sock, msg)
                except OSError:
                    w.closing = True
                    self.fifo[i].appendleft(msg)
                    continue
            w.retained.append(msg)
            w.pulled += 1
        self.ring(i)

    def settle(self, r: _Remote, taken: int) -> None:
        while r.taken < taken and r.retained:
            r.retained.popleft()
            r.taken += 1
        r.taken = max(r.taken, taken)

    def put_back(self, r: _Remote) -> None:
        """What ``r`` was given and did not take goes back in front (lock held)."""
        back = r.returns + list(r.retained)
        r.returns = []
        r.retained.clear()
        if back:
            self.fifo[r.end].extendleft(reversed(back))
            self.cond.notify_all()
            self.serve_waiting(r.end)
            d = self.direct
            if d is not None and d.end == 1 - r.end:
                d.wake()

    def remove(self, r: _Remote, received: int | None) -> None:
        """``r`` is closed or its process ended (lock held)."""
        if r.gone:
            return
        r.gone = True
        r.closing = True
        self.reader = [x if x is not r else None for x in self.reader]
        self.remotes.pop(r.copy_id, None)
        if r in self.waiting[r.end]:
            self.waiting[r.end].remove(r)
        self.put_back(r)
        if received is not None and r.pushed > received and self.readers(r.end) > 0:
            log.error("fiber: %d message(s) sent on a Pipe were lost: the process that held "
                      "the reading end closed it while they were on their way",
                      r.pushed - received)
        for g in list(self.early.values()):
            if g.issuer == r.copy_id:
                self.register(g.ticket)
        self.cond.notify_all()
        self.update()

    def register(self, ticket: str) -> None:
        g = self.early.pop(ticket, None)
        if g is not None:
            g.registered = True
            self.cond.notify_all()

    # -- local ends --------------------------------------------------------------------------

    def activate(self, i: int) -> None:
        if not self.local_active[i]:
            with self.lock:
                if not self.local_active[i]:
                    self.local_active[i] = True
                    self.update()

    def local_send(self, i: int, data: bytes | bytearray | memoryview) -> None:
        self.activate(i)
        j = 1 - i
        r = self.direct
        if r is not None and r.end == j:
            with r.wlock:
                if self.direct is r and not r.closing:
                    try:
                        send_data(r.sock, data)
                        r.pushed += 1
                        return
                    except OSError:
                        r.closing = True
            with self.lock:
                self.update()
        with self.lock:
            if self.readers(j) == 0:
                raise BrokenPipeError(errno.EPIPE, "no process holds the other end of this Pipe")
            self.deliver(j, bytes(data))

    def local_recv(self, i: int, deadline: float | None, consume: bool) -> Any:
        """The next message for end ``i``; True/False for a poll; None on timeout."""
        self.activate(i)
        while True:
            r = self.direct
            if r is not None and r.end == 1 - i and r.owner == "local" and not self.fifo[i]:
                got = self._read_direct(r, i, deadline, consume)
                if got is not _SWITCHED:
                    return got
                continue
            with self.cond:
                while True:
                    if self.fifo[i]:
                        if not consume:
                            return True
                        msg = self.fifo[i].popleft()
                        self.ring(i)
                        return msg
                    if self.eof(i):
                        if not consume:
                            return True
                        raise EOFError("every holder of the other end of this Pipe has closed it")
                    r = self.direct
                    if r is not None and r.end == 1 - i and r.owner == "local":
                        break
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False if not consume else None
                    self.cond.wait(left)

    def _read_direct(self, r: _Remote, i: int, deadline: float | None, consume: bool) -> Any:
        if deadline is None:
            r.rlock.acquire()
        elif not r.rlock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False if not consume else None
        try:
            while True:
                if self.direct is not r or r.owner != "local" or self.fifo[i]:
                    return _SWITCHED
                if deadline is not None or not consume:
                    sock_ready, wake = r.wait(deadline)
                    if wake:
                        r.drain_wake()
                        continue
                    if not sock_ready:
                        return False if not consume else None
                try:
                    if not consume:
                        kind = peek_is_data(r.sock)
                        if kind is None:
                            raise EOFError
                        if kind:
                            return True
                    # Blocking, without a poll: the socket's receive timeout brings this
                    # loop back now and then to see whether the pipe changed mode.
                    is_ctrl, body = read_frame(r.sock)
                except BlockingIOError:
                    continue  # no frame began: look at the mode again
                except (EOFError, OSError):
                    with self.lock:
                        self.remove(r, None)
                    return _SWITCHED
                if is_ctrl:
                    self.handle(r, body)
                    continue
                return body
        finally:
            r.rlock.release()
            if r.gone:
                with self.lock:
                    if not r.relay_running:
                        r.close_fds()

    def read_one(self, r: _Remote) -> bytes | None:
        """One frame from ``r`` (its ``rlock`` held): the message, or None (a control frame,
        nothing within the receive timeout, or the end: the caller goes the long way)."""
        try:
            is_ctrl, body = read_frame(r.sock)
        except BlockingIOError:
            return None
        except (EOFError, OSError):
            with self.lock:
                self.remove(r, None)
            return None
        if not is_ctrl:
            return body
        self.handle(r, body)
        return None

    def local_closed(self, i: int) -> None:
        with self.lock:
            self.local_open[i] -= 1
            if self.local_open[i] == 0:
                self.local_active[i] = False
            self.update()

    # -- copies held elsewhere ------------------------------------------------------------

    def new_ticket(self, i: int) -> str:
        with self.lock:
            self.serial += 1
            ticket = f"c.{self.serial}"
            self.tickets[ticket] = i
            return ticket

    def abandon(self, ticket: str) -> None:
        with self.lock:
            if self.tickets.pop(ticket, None) is not None:
                self.update()
                self.cond.notify_all()

    def route(self, target: str, sock: socket.socket) -> None:
        """A copy connected (in the hub's thread, which then serves it)."""
        _, _, end, ticket, copy_id = target.split(":")
        r = _Remote(int(end), sock, copy_id, ticket)
        with self.lock:
            if self.tickets.pop(ticket, None) is not None or r.issuer == "c" \
                    or r.issuer not in self.remotes:
                r.registered = True
            else:
                self.early[ticket] = r
            self.remotes[copy_id] = r
            self.update()
            self.cond.notify_all()
        self.relay(r)

    def relay(self, r: _Remote) -> None:
        """Read ``r``'s connection for as long as it is this thread's to read."""
        while True:
            with r.rlock:
                while r.owner == "relay" and not r.gone:
                    _, wake = r.wait(None)
                    if wake:
                        r.drain_wake()
                        continue
                    try:
                        is_ctrl, body = read_frame(r.sock)
                    except BlockingIOError:
                        continue  # no frame began within the receive timeout
                    except (EOFError, OSError):
                        with self.lock:
                            self.remove(r, None)
                        break
                    if is_ctrl:
                        self.handle(r, body)
                    else:
                        self.remote_data(r, body)
            with self.lock:
                if r.gone:
                    r.relay_running = False
                    r.close_fds()
                    return
                if r.owner != "relay":
                    r.relay_running = False
                    return

    def remote_data(self, r: _Remote, msg: bytes) -> None:
        with self.cond:
            while not r.registered and not r.gone:
                issuer = self.remotes.get(r.issuer)
                if issuer is None:
                    self.register(r.ticket)
                    break
                self.cond.wait()
            i = 1 - r.end
            if self.readers(i):
                self.deliver(i, msg)

    def handle(self, r: _Remote, body: bytes) -> None:
        """A control frame from copy ``r`` (the reader of its socket calls this)."""
        kind = body[:1]
        with self.lock:
            if kind == PIPE_ACTIVE:
                r.active = True
                self.update()
                if self.direct is not r:
                    with r.wlock:
                        r.send_ctrl(PIPE_MODE, b"s")
            elif kind == PIPE_WANT:
                self.settle(r, U64.unpack_from(body, 1)[0])
                if self.direct is r or r.closing:
                    return
                i = r.end
                if self.fifo[i]:
                    self.waiting[i].append(r)
                    self.serve_waiting(i)
                elif self.eof(i):
                    with r.wlock:
                        r.send_ctrl(PIPE_EOF)
                else:
                    self.waiting[i].append(r)
            elif kind == PIPE_TICKET:
                ticket = body[1:].decode()
                if ticket in self.early:
                    self.register(ticket)
                else:
                    self.tickets[ticket] = r.end
            elif kind == PIPE_ABANDON:
                if self.tickets.pop(body[1:].decode(), None) is not None:
                    self.update()
            elif kind == PIPE_RETURN:
                r.returns.append(body[1:])
            elif kind == PIPE_CLOSING:
                self.settle(r, U64.unpack_from(body, 1)[0])
                r.closing = True
                if r in self.waiting[r.end]:
                    self.waiting[r.end].remove(r)
                self.update()
                with r.wlock:
                    r.send_ctrl(PIPE_CLOSED)
            elif kind == PIPE_CLOSE:
                self.remove(r, U64.unpack_from(body, 1)[0])
                with r.wlock:
                    r.send_ctrl(PIPE_BYE)


_pipes: weakref.WeakValueDictionary[str, _Pipe] = weakref.WeakValueDictionary()


# -- ends ----------------------------------------------------------------------------------


_copies: weakref.WeakSet[PipeEnd] = weakref.WeakSet()  # copies held here of pipes made elsewhere


class PipeEnd(Connection):
    """One end of a :func:`Pipe`, or a copy of one; see the module's docstring."""

    def __init__(self, hub: str, pipe_id: str, index: int, readable: bool, writable: bool,
                 state: _Pipe | None) -> None:
        super().__init__(None, readable, writable)
        self._hub = hub
        self._pipe_id = pipe_id
        self._index = index
        self._state = state  # the pipe, in the creating process
        self._fast = False
        if state is not None:
            with state.lock:
                state.local_open[index] += 1
            return
        # A copy held in another process.
        self._copy_id = os.urandom(6).hex()
        self._rlock = threading.Lock()
        self._wlock = threading.Lock()
        self._active = False
        self._mode = b""  # b"d" (direct), b"s" (ask with WANT), b"" (not told yet)
        self._want = False
        self._taken = 0  # messages taken that came on a WANT
        self._received = 0  # messages that came directly
        self._eof = False
        self._serial = 0
        self._fast = False  # told "direct", open, not at the end: recv reads the socket as is
        self._unread: list[bytes] = []  # direct messages read while closing
        self._acks = {PIPE_CLOSED: False, PIPE_BYE: False}

    # -- pickling ------------------------------------------------------------------------

    def __reduce__(self) -> tuple:
        if self._closed:
            raise PicklingError("a closed Pipe end cannot be sent to another process")
        run = pickling_for()
        state = self._state
        if state is not None:
            ticket = state.new_ticket(self._index)
            if run is not None:
                run.on_finish(lambda: state.abandon(ticket))
            hub = outgoing_addresses(self._hub)
        else:
            self._serial += 1
            ticket = f"{self._copy_id}.{self._serial}"
            self._send_ctrl(PIPE_TICKET, ticket.encode())
            if run is not None:
                run.on_finish(lambda: self._abandon(ticket))
            hub = self._hub
        return (_rebuild_pipe_end,
                (hub, self._pipe_id, self._index, ticket, self._readable, self._writable))

    def _abandon(self, ticket: str) -> None:
        try:
            self._send_ctrl(PIPE_ABANDON, ticket.encode())
        except OSError:
            pass

    # -- the Connection API ------------------------------------------------------------------

    def _socket(self) -> socket.socket:
        if self._closed:
            raise OSError("handle is closed")
        if self._sock is None:
            raise OSError("this Pipe end has no connection here")
        return self._sock

    def fileno(self) -> int:
        if self._closed:
            raise OSError("handle is closed")
        if self._state is not None:
            return self._state.local_fileno(self._index)
        self._activate()
        sock = self._socket()
        if self._readable:
            with self._rlock:
                while not self._mode and not self._eof:  # the creator answers ACTIVE at once
                    try:
                        is_ctrl, body = read_frame(sock)
                    except EOFError:
                        self._eof = True
                        break
                    if is_ctrl:
                        self._on_ctrl(body)
                with self._wlock:
                    if self._mode == b"s" and not self._want and not self._eof:
                        self._want = True  # so that the descriptor wakes when a message is here
                        sock.sendall(control_frame(PIPE_WANT, U64.pack(self._taken)))
        return sock.fileno()

    def _send(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise OSError("handle is closed")
        st = self._state
        if st is None:  # a copy
            if not self._active:
                self._activate()
            with self._wlock:
                send_data(self._sock or self._socket(), data)
            return
        r = st.direct
        if r is not None and r.end != self._index and st.local_active[self._index]:
            with r.wlock:  # the usual case, kept short: one end here, one copy there
                if st.direct is r and not r.closing:
                    try:
                        send_data(r.sock, data)
                        r.pushed += 1
                        return
                    except OSError:
                        r.closing = True
        st.local_send(self._index, data)

    def _recv(self, maxlength: int | None = None) -> bytes:
        if self._closed:
            raise OSError("handle is closed")
        st = self._state
        msg: Any = None
        if st is not None:
            i = self._index
            r = st.reader[i]
            if r is not None and not st.fifo[i] and r.rlock.acquire(False):
                # The usual case: this end reads one copy's socket, straight.
                try:
                    if st.reader[i] is r and not st.fifo[i]:
                        msg = st.read_one(r)
                finally:
                    r.rlock.release()
        elif self._fast:
            # The usual case of a copy: told "direct", its messages come unasked.
            try:
                is_ctrl, body = read_frame(self._sock)  # type: ignore[arg-type]
            except EOFError:
                self._eof = True
                self._fast = False
            else:
                if is_ctrl:
                    self._on_ctrl(body)
                else:
                    msg = body
                    self._received += 1
        if msg is None:
            msg = self._next(None, True)
        if maxlength is not None and len(msg) > maxlength:
            self.close()
            raise OSError("bad message length")
        return msg

    def poll(self, timeout: float | None = 0.0) -> bool:
        if self._closed:
            raise OSError("handle is closed")
        self._check_readable()
        return bool(self._next(_deadline(timeout), False))

    def _next(self, deadline: float | None, consume: bool) -> Any:
        state = self._state
        if state is not None:
            return state.local_recv(self._index, deadline, consume)
        if not self._active:
            self._activate()
        sock = self._socket()
        if deadline is None:
            self._rlock.acquire()
        elif not self._rlock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False if not consume else None
        try:
            while True:
                if self._eof:
                    if consume:
                        raise EOFError("every holder of the other end of this Pipe has closed it")
                    return True
                if self._mode == b"s" and not self._want:
                    with self._wlock:
                        self._want = True
                        sock.sendall(control_frame(PIPE_WANT, U64.pack(self._taken)))
                if deadline is not None and not _wait_readable([sock.fileno()], deadline):
                    return False if not consume else None
                try:
                    if not consume:
                        kind = peek_is_data(sock)
                        if kind is None:
                            raise EOFError
                        if kind:
                            return True
                    is_ctrl, body = read_frame(sock)
                except EOFError:
                    self._eof = True  # the creator ended
                    self._fast = False
                    continue
                if is_ctrl:
                    self._on_ctrl(body)
                    continue
                if self._want:
                    self._want = False
                    self._taken += 1
                else:
                    self._received += 1
                return body
        finally:
            self._rlock.release()

    def _on_ctrl(self, body: bytes) -> None:
        kind = body[:1]
        if kind == PIPE_MODE:
            self._mode = body[1:2]
            if self._mode == b"d":
                self._want = False  # the creator dropped the request: messages now come unasked
        elif kind == PIPE_EOF:
            self._eof = True
        elif kind in self._acks:
            self._acks[kind] = True
        self._fast = self._mode == b"d" and not self._eof and not self._closed

    def _activate(self) -> None:
        if not self._active:
            with self._wlock:
                if not self._active:
                    self._active = True
                    self._socket().sendall(control_frame(PIPE_ACTIVE))

    def _send_ctrl(self, kind: bytes, body: bytes = b"") -> None:
        with self._wlock:
            self._socket().sendall(control_frame(kind, body))

    # -- closing -------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fast = False
        state = self._state
        if state is not None:
            state.local_closed(self._index)
            return
        sock, self._sock = self._sock, None
        _copies.discard(self)
        if sock is None:
            return
        try:
            with self._rlock:
                self._close_copy(sock)
        except (OSError, EOFError):
            pass
        finally:
            sock.close()

    def _creator_reads_me(self) -> bool:
        """Whether the creator's own end reads this connection (then it may not answer)."""
        return self._mode == b"d" and (self._readable and self._writable or self._index == 1)

    def _read_one(self, sock: socket.socket) -> None:
        is_ctrl, body = read_frame(sock)
        if is_ctrl:
            self._on_ctrl(body)
        elif self._want:
            self._want = False  # the creator takes it back when it reads our CLOSING
        else:
            self._received += 1
            self._unread.append(body)

    def _close_copy(self, sock: socket.socket) -> None:
        if self._active:
            while not self._mode:  # the creator answers ACTIVE at once
                self._read_one(sock)
        if not self._creator_reads_me():
            sock.sendall(control_frame(PIPE_CLOSING, U64.pack(self._taken)))
            while not self._acks[PIPE_CLOSED] and not self._creator_reads_me():
                self._read_one(sock)
        if self._creator_reads_me():
            # Nobody may read our frames soon: do not wait. Stop what is sent to us
            # (a Unix socket's writer then fails and queues it), take what is here.
            if sock.family == socket.AF_UNIX:
                sock.shutdown(socket.SHUT_RD)
            sock.setblocking(False)
            try:
                while True:
                    self._read_one(sock)
            except (BlockingIOError, EOFError):
                pass
            sock.setblocking(True)
            self._finish_close(sock)
            return
        self._finish_close(sock)
        while not self._acks[PIPE_BYE]:
            self._read_one(sock)

    def _finish_close(self, sock: socket.socket) -> None:
        frames = [control_frame(PIPE_RETURN, m) for m in self._unread]
        frames.append(control_frame(PIPE_CLOSE, U64.pack(self._received)))
        self._unread = []
        sock.sendall(b"".join(frames))

    def __del__(self) -> None:
        if getattr(self, "_closed", True) or sys.is_finalizing():
            return
        # Not here: the collector may run while this thread holds one of the locks.
        try:
            threading.Thread(target=self.close, daemon=True, name="fiber-pipe-close").start()
        except RuntimeError:  # the interpreter is shutting down
            pass

    def __repr__(self) -> str:
        where = "here" if self._state is not None else "copy"
        return f"<PipeEnd {self._pipe_id[:8]}:{self._index} {where}{' closed' if self._closed else ''}>"


def _rebuild_pipe_end(hub: str, pipe_id: str, index: int, ticket: str, readable: bool,
                      writable: bool) -> PipeEnd:
    state = _pipes.get(pipe_id)
    if state is not None:  # back in the creating process
        end = PipeEnd(hub, pipe_id, index, readable, writable, state)
        state.abandon(ticket)
        return end
    end = PipeEnd(hub, pipe_id, index, readable, writable, None)
    # Connect at once: the creator counts this copy as a holder until it closes or ends.
    end._sock = dial(hub, runtime().authkey, f"pipe:{pipe_id}:{index}:{ticket}:{end._copy_id}")
    _copies.add(end)
    return end


def settle() -> None:
    """Close, before this process ends, every copy of a Pipe end it holds.

    A copy gives back the messages sent to it that it did not read, and the
    creator sees at once that it is gone.
    """
    for end in list(_copies):
        end.close()


atexit.register(settle)


def Pipe(duplex: bool = True) -> tuple[PipeEnd, PipeEnd]:
    """Return a pair of connected ends, like :func:`multiprocessing.Pipe`.

    The ends can be given to any processes of the program, on any host, and
    shared as the stdlib's can (see the module's docstring).
    """
    rt = runtime()
    pipe_id = os.urandom(16).hex()
    state = _Pipe(pipe_id, duplex)
    _pipes[pipe_id] = state
    rt.hub.register_prefix(f"pipe:{pipe_id}:", state.route)
    a = PipeEnd(rt.hub.addresses, pipe_id, 0, True, duplex, state)
    b = PipeEnd(rt.hub.addresses, pipe_id, 1, duplex, True, state)
    return a, b
