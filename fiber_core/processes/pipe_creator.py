"""The creator's side of a Pipe at work: the copies' sockets, relay threads, waits and bells.

:class:`PipeCreator` holds a :class:`~fiber_core.processes.pipe_machine.PipeMachine`
(what the creator knows and decides) and everything that is I/O: each copy's
connection (:class:`_Link`: the socket, its locks, a wake-up pipe), the relay thread
that reads a copy's connection while no end of the creator's reads it itself, the
condition that readers wait on, and the descriptors that ``fileno()`` hands out. Every
call into the machine is made with the pipe's lock held, and its answer is carried out
before the lock is let go (:meth:`PipeCreator._run`).
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time
from typing import Any

from fiber_core.base.errors import PipeCutError
from fiber_core.base.log import log
from fiber_core.processes.pipe_machine import (
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
from fiber_core.wire.control import peek_is_data, read_frame, send_data

_WAIT = struct.pack("ll", 0, 50_000)  # SO_RCVTIMEO of a copy's socket in the creator: 50 ms

_END_WAIT = 5.0  # after a send to a copy failed: its end (or its close) is read within this

_READ_ACKS = 63  # a writer that reads nothing reads its copy's acknowledgements every 64 sends

SWITCHED = object()  # a local read stopped because the pipe changed mode
_AGAIN = object()  # no message yet: read again


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


class _Link:
    """The creator's connection to one copy held in another process."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.copy: Copy | None = None  # the machine's record, once it knows the copy
        self.wlock = threading.Lock()  # one writer of frames at a time
        self.rlock = threading.Lock()  # one reader of the socket at a time
        self.relay_running = True
        self.pushed = 0  # messages sent to it directly (unasked)
        self.wake_r, self.wake_w = os.pipe()  # readable: the reader must look at who reads again
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _WAIT)
        self.poller = select.poll()  # used by the holder of ``rlock``
        self.poller.register(sock.fileno(), select.POLLIN)
        self.poller.register(self.wake_r, select.POLLIN)

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

    def sock_ready(self) -> bool:
        """Whether the socket has something to read now (``rlock`` held)."""
        return any(fd != self.wake_r for fd, _ in self.poller.poll(0))

    def close_fds(self) -> None:
        """Release the descriptors of a copy that is gone (the pipe's lock is held)."""
        fds, self.wake_r, self.wake_w = (self.wake_r, self.wake_w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        self.sock.close()


class PipeCreator:
    """The creator's state of one Pipe and its I/O; see the module's docstring."""

    def __init__(self, pipe_id: str, duplex: bool) -> None:
        self.id = pipe_id
        self.machine = PipeMachine(duplex)
        self.lock = threading.RLock()  # reentrant: a dropped end may close from the GC
        self.cond = threading.Condition(self.lock)
        self.bells: list[_Bell | None] = [None, None]
        self.waiters = 0  # threads in _wait(): only then is there anyone to notify
        self.cuts = [0, 0]  # per end here: messages it sent to a copy that was cut, not yet raised

    def _wait(self, timeout: float | None = None) -> None:
        """Wait (lock held) until the machine's state changed, or ``timeout``."""
        self.waiters += 1
        try:
            self.cond.wait(timeout)
        finally:
            self.waiters -= 1

    # -- carrying out the machine's answers (lock held) ------------------------------------------

    def _run(self, outs: list[Output]) -> None:
        while outs:
            broken: dict[Copy, list[bytes]] | None = None  # sends that failed, what they missed
            for out in outs:
                if type(out) is Data or type(out) is Control:
                    if (broken is None or out.copy not in broken) and self._send(out):
                        continue
                    broken = broken if broken is not None else {}
                    missed = broken.setdefault(out.copy, [])
                    if type(out) is Data:
                        missed.append(out.message)
                elif type(out) is Handoff:
                    self._handoff(out.copy)
                elif type(out) is Wake:
                    out.copy.io.wake()
                elif type(out) is Closed:
                    lost = out.copy.io.pushed - out.received
                    if lost > 0:
                        log.error("fiber: %d message(s) sent on a Pipe were lost: the process that "
                                  "held the reading end closed it while they were on their way", lost)
                elif type(out) is Cut:
                    self._cut(out.copy, out.acked, out.dropped)
            if broken is None:
                break
            outs = [o for r, unsent in broken.items() for o in self.machine.failed(r, unsent)]
        if self.waiters:
            self.cond.notify_all()
        if self.bells[0] is not None or self.bells[1] is not None:
            self.ring(0)
            self.ring(1)

    def _send(self, out: Data | Control) -> bool:
        """Send one frame of an answer: False if the copy's socket failed."""
        link: _Link = out.copy.io
        try:
            with link.wlock:
                if isinstance(out, Control):
                    link.sock.sendall(out.frame)
                else:
                    send_data(link.sock, out.message)
                    if out.pushed:
                        link.pushed += 1
            return True
        except OSError:
            return False

    def _cut(self, r: Copy, acked: int, dropped: int) -> None:
        """``r`` was lost before it closed: what was pushed to it and not acknowledged, and
        what waited for it, is raised by the creator's end that writes to it, at its next call."""
        unknown = r.io.pushed - acked + dropped
        if unknown > 0:
            self.cuts[1 - r.end] += unknown
            log.warning("fiber: the connection to a process reading a Pipe ended without it "
                        "closing its end (its process ended, or the connection was cut): %d "
                        "message(s) sent to it may not have arrived", unknown)

    def _raise_cut(self, i: int) -> None:
        with self.lock:
            unknown, self.cuts[i] = self.cuts[i], 0
        if unknown:
            raise PipeCutError(unacknowledged=unknown)

    def _settle_readers(self, i: int) -> None:
        """After a send of end ``i`` failed (lock held): wait, within a bound, until every copy
        of the other end that may not take messages anymore has ended, so that a cut among
        them is raised by this call rather than a plain ``BrokenPipeError``."""
        deadline = time.monotonic() + _END_WAIT
        while self.machine.unsettled(1 - i) and deadline > time.monotonic():
            self._wait(deadline - time.monotonic())

    def _handoff(self, r: Copy) -> None:
        link: _Link = r.io
        link.wake()
        if not r.local_reader and not r.gone and not link.relay_running:
            link.relay_running = True
            threading.Thread(target=self.relay, args=(r,), daemon=True,
                             name="fiber-pipe-relay").start()

    def ring(self, i: int) -> None:
        bell = self.bells[i]
        if bell is not None:
            bell.set(self.machine.ready(i))

    # -- the creator's ends --------------------------------------------------------------------

    def opened(self, i: int) -> None:
        with self.lock:
            self.machine.opened(i)

    def activate(self, i: int) -> None:
        if not self.machine.local_active[i]:
            with self.lock:
                self._run(self.machine.activate(i))

    def closed(self, i: int) -> None:
        with self.lock:
            self._run(self.machine.closed(i))

    def new_ticket(self, i: int) -> str:
        with self.lock:
            return self.machine.new_ticket(i)

    def abandon(self, ticket: str) -> None:
        with self.lock:
            self._run(self.machine.abandon(ticket))

    def send(self, i: int, data: bytes | bytearray | memoryview) -> None:
        """End ``i`` writes ``data``: straight to the copy it talks to, or through the machine."""
        if self.cuts[i]:
            self._raise_cut(i)
        m = self.machine
        r = m.direct
        if r is not None and r.end != i and m.local_active[i]:
            link: _Link = r.io
            sent = failed = False
            with link.wlock:  # the usual case, kept short: one end here, one copy there
                if m.direct is r and not r.closing:
                    try:
                        send_data(link.sock, data)
                        link.pushed += 1
                        sent = True
                    except OSError:
                        failed = True
            if sent:
                if not link.pushed & _READ_ACKS and r.local_reader:
                    self._read_acks(r)
                return
            if failed:
                with self.cond:
                    self._run(m.failed(r, []))
                    self._settle_readers(i)
                if self.cuts[i]:
                    self._raise_cut(i)
        self.activate(i)
        with self.cond:
            try:
                self._run(m.send(i, bytes(data)))
                return
            except BrokenPipeError:
                self._settle_readers(i)
                if not self.cuts[i]:
                    raise
        self._raise_cut(i)

    def _read_acks(self, r: Copy) -> None:
        """Read the control frames at the head of ``r``'s connection now (its
        acknowledgements, which an end here that only writes would otherwise leave unread),
        unless a thread here reads it already; a message it wrote stays for that end's reader."""
        link: _Link = r.io
        if not link.rlock.acquire(False):
            return
        try:
            while r.local_reader and not r.gone and link.sock_ready():
                if self._frame_from(r, False) is not _AGAIN:
                    break  # a message is next (True), or the connection ended (SWITCHED)
        finally:
            self._done_reading(r, link)

    def _done_reading(self, r: Copy, link: _Link) -> None:
        """Release ``link``'s read lock; close the fds of a copy that is gone, unless its
        relay still runs."""
        link.rlock.release()
        if r.gone:
            with self.lock:
                if not link.relay_running:
                    link.close_fds()

    def recv_direct(self, i: int) -> bytes | None:
        """The usual read of end ``i``: one frame of the copy whose socket it reads, if no
        other thread reads it and nothing is queued; None: go the long way."""
        m = self.machine
        r = m.reader[i]
        if r is None or m.fifo[i]:
            return None
        link: _Link = r.io
        if not link.rlock.acquire(False):
            return None
        try:
            if m.reader[i] is not r or m.fifo[i]:
                return None
            try:
                is_ctrl, body = read_frame(link.sock)
            except BlockingIOError:
                return None
            except (EOFError, OSError):
                self.lost(r)
                return None
            if not is_ctrl:
                return body
            self.control(r, body)
            return None
        finally:
            link.rlock.release()

    def recv(self, i: int, deadline: float | None, consume: bool) -> Any:
        """The next message for end ``i``; True/False for a poll; None on timeout."""
        if self.cuts[i]:
            self._raise_cut(i)
        self.activate(i)
        m = self.machine
        while True:
            r = m.direct
            if r is not None and r.end == 1 - i and r.local_reader and not m.fifo[i]:
                got = self._read_direct(r, i, deadline, consume)
                if got is not SWITCHED:
                    return got
                continue
            with self.cond:
                while True:
                    if m.fifo[i]:
                        if not consume:
                            return True
                        msg = m.take(i)
                        self.ring(i)
                        return msg
                    if m.eof(i):
                        if not consume:
                            return True
                        raise EOFError("every holder of the other end of this Pipe has closed it")
                    r = m.direct
                    if r is not None and r.end == 1 - i and r.local_reader:
                        break
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False if not consume else None
                    self._wait(left)

    def _read_direct(self, r: Copy, i: int, deadline: float | None, consume: bool) -> Any:
        link: _Link = r.io
        if deadline is None:
            link.rlock.acquire()
        elif not link.rlock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False if not consume else None
        try:
            while True:
                if self.machine.direct is not r or not r.local_reader or self.machine.fifo[i]:
                    return SWITCHED
                if deadline is not None or not consume:
                    sock_ready, wake = link.wait(deadline)
                    if wake:
                        link.drain_wake()
                        continue
                    if not sock_ready:
                        return False if not consume else None
                got = self._frame_from(r, consume)
                if got is not _AGAIN:
                    return got
        finally:
            self._done_reading(r, link)

    def _frame_from(self, r: Copy, consume: bool) -> Any:
        """One frame of ``r``'s socket for the creator's end that reads it (``rlock`` held):
        the message (True for a poll), ``SWITCHED`` at its end, or ``_AGAIN``."""
        link: _Link = r.io
        try:
            if not consume:
                kind = peek_is_data(link.sock)
                if kind is None:
                    raise EOFError
                if kind:
                    return True
            # Blocking, without a poll: the socket's receive timeout brings the caller's
            # loop back now and then to see whether the pipe changed mode.
            is_ctrl, body = read_frame(link.sock)
        except BlockingIOError:
            return _AGAIN  # no frame began: look at the mode again
        except (EOFError, OSError):
            self.lost(r)
            return SWITCHED
        if is_ctrl:
            self.control(r, body)
            return _AGAIN
        return body

    def fileno(self, i: int) -> int:
        """A descriptor that is readable when end ``i`` has something to read.

        As with the stdlib, it is the connection's socket when this end talks to
        one copy of the other end directly (so ``multiprocessing.reduction`` can
        pass descriptors on it); if that copy is on its way, it waits for it.
        """
        self.activate(i)
        with self.cond:
            while True:
                outs, answer = self.machine.fileno(i)
                self._run(outs)
                if answer is WAIT:
                    self._wait()
                    continue
                if isinstance(answer, Copy):
                    return answer.io.sock.fileno()
                if self.bells[i] is None:
                    self.bells[i] = _Bell()
                self.ring(i)
                bell = self.bells[i]
                assert bell is not None
                return bell.r

    # -- copies held elsewhere ------------------------------------------------------------

    def route(self, target: str, sock: socket.socket) -> None:
        """A copy connected (in the hub's thread, which then serves it)."""
        _, _, end, ticket, copy_id = target.split(":")
        link = _Link(sock)
        with self.lock:
            r, outs = self.machine.connected(int(end), copy_id, ticket, link)
            link.copy = r
            self._run(outs)
        self.relay(r)

    def relay(self, r: Copy) -> None:
        """Read ``r``'s connection for as long as it is this thread's to read."""
        link: _Link = r.io
        while True:
            with link.rlock:
                while not r.local_reader and not r.gone:
                    _, wake = link.wait(None)
                    if wake:
                        link.drain_wake()
                        continue
                    try:
                        is_ctrl, body = read_frame(link.sock)
                    except BlockingIOError:
                        continue  # no frame began within the receive timeout
                    except (EOFError, OSError):
                        self.lost(r)
                        break
                    if is_ctrl:
                        self.control(r, body)
                    else:
                        self.data(r, body)
            with self.lock:
                if r.gone:
                    link.relay_running = False
                    link.close_fds()
                    return
                if r.local_reader:
                    link.relay_running = False
                    return

    def data(self, r: Copy, msg: bytes) -> None:
        with self.cond:
            while not r.registered and not self.machine.may_queue(r):
                self._wait()
            self._run(self.machine.data(r, msg))

    def control(self, r: Copy, body: bytes) -> None:
        """A control frame from copy ``r`` (the reader of its socket calls this)."""
        with self.lock:
            self._run(self.machine.control(r, body))

    def lost(self, r: Copy) -> None:
        with self.lock:
            self._run(self.machine.lost(r))
