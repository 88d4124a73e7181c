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

Cuts. A reading copy acknowledges what comes to it (``PIPE_ACK``, cumulative):
every 64th message pushed to it, and each message it asked for before ``recv``
returns it, so that a message a reader took is never handed to another. When a
copy's connection ends without it closing (its process was killed, or the
connection was cut), the creator's end that pushed to it raises
:class:`~fiber_core.base.errors.PipeCutError` at its next call with the number it
had not heard acknowledged, and the copy raises it from ``recv`` instead of a plain
end of file: a possible loss is reported on both sides, never silent.

Messages between a copy and the creator: data frames (the program's messages)
and control frames on one connection, both read and written by
``wire/control.py``; the control kinds (``PIPE_*``) are defined, with the run's
others, in ``fiber_core/wire/messages.py``.

A copy connects to the creator's hub with the target
``pipe:<pipe id>:<end>:<ticket>:<copy id>``; a ticket is ``<issuer copy id>.<n>``
(the creator's copy id is ``c``).

The parts: :class:`CreatorEnd` is an end in the creator, :class:`CopyEnd` one
anywhere else (both are :class:`PipeEnd`). The creator's state and decisions are
``processes/pipe_machine.py`` (a state machine with no I/O), carried out with
sockets, threads and waits by ``processes/pipe_creator.py``.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import select
import socket
import struct
import sys
import termios
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from fiber_core.base.errors import PicklingError, PipeCutError
from fiber_core.processes.pipe_creator import PipeCreator
from fiber_core.processes.process import pickling_for
from fiber_core.runtime.hub import dial
from fiber_core.runtime.run import outgoing_addresses, runtime
from fiber_core.wire.control import ACK, U64, control_frame, peek_is_data, read_frame, send_data
from fiber_core.wire.framing import Connection
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


_AGAIN = object()  # a read found no message yet: read again

ACK_EVERY = 64  # a copy acknowledges every 64th message pushed to it (one frame, not one each)

ACK_ROOM = 4096  # ... unless more bytes than this that it sent are still unread by the creator


_OUTQ = struct.Struct("i")


def _unread(sock: socket.socket) -> int:
    """Bytes written on ``sock`` that its peer has not read yet (0 where the system cannot say)."""
    try:
        return _OUTQ.unpack(fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(_OUTQ.size)))[0]
    except OSError:
        return 0


_pipes: weakref.WeakValueDictionary[str, PipeCreator] = weakref.WeakValueDictionary()


# -- ends ----------------------------------------------------------------------------------


class PipeEnd(Connection):
    """One end of a :func:`Pipe` as a process holds it: a :class:`CreatorEnd` in the
    process that called ``Pipe()``, a :class:`CopyEnd` anywhere else; see the module's
    docstring."""

    _where = ""

    def __init__(self, hub: str, pipe_id: str, index: int, readable: bool, writable: bool) -> None:
        super().__init__(None, readable, writable)
        self._hub = hub
        self._pipe_id = pipe_id
        self._index = index

    def __reduce__(self) -> tuple:
        if self._closed:
            raise PicklingError("a closed Pipe end cannot be sent to another process")
        run = pickling_for()
        ticket, hub, abandon = self._ticket()
        if run is not None:
            run.on_finish(abandon)
        return (_rebuild_pipe_end,
                (hub, self._pipe_id, self._index, ticket, self._readable, self._writable))

    def _ticket(self) -> tuple[str, str, Callable[[], None]]:
        """A ticket for a copy of this end pickled now, the hub it connects to, and what
        to do if it never arrives."""
        raise NotImplementedError

    def _socket(self) -> socket.socket:
        if self._closed:
            raise OSError("handle is closed")
        if self._sock is None:
            raise OSError("this Pipe end has no connection here")
        return self._sock

    def poll(self, timeout: float | None = 0.0) -> bool:
        if self._closed:
            raise OSError("handle is closed")
        self._check_readable()
        return bool(self._next(_deadline(timeout), False))

    def _next(self, deadline: float | None, consume: bool) -> Any:
        """The next message (``consume``) or whether one is there; None/False at the deadline."""
        raise NotImplementedError

    def _too_long(self, msg: bytes, maxlength: int) -> bytes:
        if len(msg) > maxlength:
            self.close()
            raise OSError("bad message length")
        return msg

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._close()

    def _close(self) -> None:
        raise NotImplementedError

    def __del__(self) -> None:
        if getattr(self, "_closed", True) or sys.is_finalizing():
            return
        # Not here: the collector may run while this thread holds one of the locks.
        try:
            threading.Thread(target=self.close, daemon=True, name="fiber-pipe-close").start()
        except RuntimeError:  # the interpreter is shutting down
            pass

    def __repr__(self) -> str:
        closed = " closed" if self._closed else ""
        return f"<PipeEnd {self._pipe_id[:8]}:{self._index} {self._where}{closed}>"


class CreatorEnd(PipeEnd):
    """An end in the process that called ``Pipe()``: the pipe's state is here
    (:class:`~fiber_core.processes.pipe_creator.PipeCreator`), and the end works through it."""

    _where = "here"

    def __init__(self, hub: str, pipe_id: str, index: int, readable: bool, writable: bool,
                 state: PipeCreator) -> None:
        super().__init__(hub, pipe_id, index, readable, writable)
        self._state = state
        state.opened(index)

    def _ticket(self) -> tuple[str, str, Callable[[], None]]:
        state = self._state  # not the end: a lost copy must not keep this end alive
        ticket = state.new_ticket(self._index)
        return ticket, outgoing_addresses(self._hub), lambda: state.abandon(ticket)

    def fileno(self) -> int:
        if self._closed:
            raise OSError("handle is closed")
        return self._state.fileno(self._index)

    def _send(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise OSError("handle is closed")
        self._state.send(self._index, data)

    def _recv(self, maxlength: int | None = None) -> bytes:
        if self._closed:
            raise OSError("handle is closed")
        state = self._state
        msg = state.recv_direct(self._index)  # the usual case: one copy's socket, straight
        if msg is None:
            msg = state.recv(self._index, None, True)
        return msg if maxlength is None else self._too_long(msg, maxlength)

    def _next(self, deadline: float | None, consume: bool) -> Any:
        return self._state.recv(self._index, deadline, consume)

    def _close(self) -> None:
        self._state.closed(self._index)


_copies: weakref.WeakSet[CopyEnd] = weakref.WeakSet()  # copies held here of pipes made elsewhere


class CopyEnd(PipeEnd):
    """A copy of an end held in another process than the creator's: it talks to the
    creator on its own connection, with data and control frames (``wire/control.py``)."""

    _where = "copy"

    def __init__(self, hub: str, pipe_id: str, index: int, readable: bool, writable: bool) -> None:
        super().__init__(hub, pipe_id, index, readable, writable)
        self._copy_id = os.urandom(6).hex()
        self._rlock = threading.Lock()
        self._wlock = threading.Lock()
        self._active = False
        self._mode = b""  # b"d" (direct), b"s" (ask with WANT), b"" (not told yet)
        self._want = False
        self._taken = 0  # messages taken that came on a WANT
        self._received = 0  # messages that came directly
        self._acked = 0  # of those, how many it had when it last acknowledged (or tried to)
        self._eof = False
        self._cut = False  # the connection ended without the creator saying so: PipeCutError
        self._serial = 0
        self._fast = False  # told "direct", open, not at the end: recv reads the socket as is
        self._unread: list[bytes] = []  # direct messages read while closing
        self._acks = {PIPE_CLOSED: False, PIPE_BYE: False}

    @classmethod
    def arrived(cls, hub: str, pipe_id: str, index: int, ticket: str, readable: bool,
                writable: bool) -> CopyEnd:
        """The copy that ``ticket`` announced, connected to the creator."""
        copy = cls(hub, pipe_id, index, readable, writable)
        # Connect at once: the creator counts this copy as a holder until it closes or ends.
        copy._sock = dial(hub, runtime().authkey, f"pipe:{pipe_id}:{index}:{ticket}:{copy._copy_id}")
        _copies.add(copy)
        return copy

    def _ticket(self) -> tuple[str, str, Callable[[], None]]:
        self._serial += 1
        ticket = f"{self._copy_id}.{self._serial}"
        self._send_ctrl(PIPE_TICKET, ticket.encode())
        return ticket, self._hub, lambda: self._abandon(ticket)

    def _abandon(self, ticket: str) -> None:
        try:
            self._send_ctrl(PIPE_ABANDON, ticket.encode())
        except OSError:
            pass

    # -- the Connection API ------------------------------------------------------------------

    def fileno(self) -> int:
        if self._closed:
            raise OSError("handle is closed")
        self._activate()
        sock = self._socket()
        if self._readable:
            with self._rlock:
                while not self._mode and not self._eof:  # the creator answers ACTIVE at once
                    try:
                        is_ctrl, body = read_frame(sock)
                    except (EOFError, OSError):
                        self._ended()
                        break
                    if is_ctrl:
                        self._on_ctrl(body)
                if not self._eof:
                    self._ask(sock)  # so that the descriptor wakes when a message is here
        return sock.fileno()

    def _send(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise OSError("handle is closed")
        if not self._active:
            self._activate()
        with self._wlock:
            send_data(self._sock or self._socket(), data)

    def _recv(self, maxlength: int | None = None) -> bytes:
        if self._closed:
            raise OSError("handle is closed")
        msg: Any = None
        if self._fast:
            # The usual case: told "direct", its messages come unasked.
            try:
                is_ctrl, body = read_frame(self._sock)  # type: ignore[arg-type]
            except (EOFError, OSError):
                self._ended()
            else:
                if is_ctrl:
                    self._on_ctrl(body)
                else:
                    msg = body
                    self._received += 1
                    if self._received - self._acked >= ACK_EVERY:
                        self._ack_pushed()
        if msg is None:
            msg = self._next(None, True)
        return msg if maxlength is None else self._too_long(msg, maxlength)

    def _next(self, deadline: float | None, consume: bool) -> Any:
        if not self._active:
            self._activate()
        sock = self._socket()
        if deadline is None:
            self._rlock.acquire()
        elif not self._rlock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False if not consume else None
        try:
            while True:
                got = self._step(sock, deadline, consume)
                if got is not _AGAIN:
                    return got
        finally:
            self._rlock.release()

    def _step(self, sock: socket.socket, deadline: float | None, consume: bool) -> Any:
        """One frame for ``_next`` (``rlock`` held): its answer, or ``_AGAIN``."""
        if self._eof:
            if not consume:
                return True
            if self._cut:
                raise PipeCutError(received=self._received + self._taken)
            raise EOFError("every holder of the other end of this Pipe has closed it")
        try:
            self._ask(sock)
            if deadline is not None and not _wait_readable([sock.fileno()], deadline):
                return False if not consume else None
            if not consume:
                kind = peek_is_data(sock)
                if kind is None:
                    raise EOFError
                if kind:
                    return True
            is_ctrl, body = read_frame(sock)
        except (EOFError, OSError):
            self._ended()
            return _AGAIN
        if is_ctrl:
            self._on_ctrl(body)
            return _AGAIN
        if self._want:
            self._want = False
            self._taken += 1
            try:
                self._ack()  # before the program has it: the creator must not hand it out again
            except OSError:
                self._taken -= 1  # not taken: the creator, which never heard of it, hands it out again
                self._ended()
                return _AGAIN
        else:
            self._received += 1
            if self._received - self._acked >= ACK_EVERY:
                self._ack_pushed()
        return body

    def _ended(self) -> None:
        """The connection ended: the creator's process ended, or the connection was cut
        (the end of the pipe is a PIPE_EOF, read before)."""
        if not self._eof:
            self._eof = self._cut = True
        self._fast = False

    def _ack(self) -> None:
        """Tell the creator what came to this copy so far (PIPE_ACK)."""
        self._acked = self._received
        with self._wlock:
            self._socket().sendall(control_frame(PIPE_ACK, ACK.pack(self._received, self._taken)))

    def _ack_pushed(self) -> None:
        """Acknowledge the messages pushed so far, unless the creator has not read what this
        copy sent before: an end there that only writes (or a backlog pushed as this copy
        became active) may read nothing for a while, and acknowledgements must never fill
        the connection for the frames that have to pass (a close). A later one says more."""
        self._acked = self._received  # skipped or not, the next try comes ACK_EVERY later
        sock = self._sock
        if sock is None or _unread(sock) > ACK_ROOM or not self._wlock.acquire(False):
            return
        try:
            frame = control_frame(PIPE_ACK, ACK.pack(self._received, self._taken))
            sent = sock.send(frame, socket.MSG_DONTWAIT)
            if sent < len(frame):  # a stream socket took part of it: the rest must follow
                sock.sendall(frame[sent:])
        except OSError:
            pass  # full (BlockingIOError), or the connection ended: the next read finds it
        finally:
            self._wlock.release()

    def _ask(self, sock: socket.socket) -> None:
        """In queued mode, ask the creator for one message unless asked already."""
        if self._mode == b"s" and not self._want:
            with self._wlock:
                self._want = True
                sock.sendall(control_frame(PIPE_WANT, U64.pack(self._taken)))

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

    def _close(self) -> None:
        self._fast = False
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


def _rebuild_pipe_end(hub: str, pipe_id: str, index: int, ticket: str, readable: bool,
                      writable: bool) -> PipeEnd:
    state = _pipes.get(pipe_id)
    if state is not None:  # back in the creating process
        end = CreatorEnd(hub, pipe_id, index, readable, writable, state)
        state.abandon(ticket)
        return end
    return CopyEnd.arrived(hub, pipe_id, index, ticket, readable, writable)


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
    state = PipeCreator(pipe_id, duplex)
    _pipes[pipe_id] = state
    rt.hub.register_prefix(f"pipe:{pipe_id}:", state.route)
    a = CreatorEnd(rt.hub.addresses, pipe_id, 0, True, duplex, state)
    b = CreatorEnd(rt.hub.addresses, pipe_id, 1, duplex, True, state)
    return a, b
