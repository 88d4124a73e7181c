"""``Pipe``: two connected ends that work in any processes of a run, on any hosts.

An end is a :class:`~fiber_core.wire.framing.Connection` that connects on first
use: to its peer through a local socket pair while both stay in the creating
process, or, once sent to a child, to the creator's hub, which hands it the
other end's socket (or relays between the two when both left). What travels is
the program's own data: a Pipe has no message kinds of its own.
"""

from __future__ import annotations

import os
import socket
import threading
import time

from fiber_core.base.errors import PicklingError
from fiber_core.processes.process import pickling_for
from fiber_core.runtime.hub import dial
from fiber_core.runtime.run import outgoing_addresses, runtime
from fiber_core.wire.framing import Connection


class _PipeState:
    """Creator-side state of one Pipe: where each end lives, and its socket once known."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent = [False, False]  # end i was pickled to another process
        self.socks: list[socket.socket | None] = [None, None]
        self.arrived = [threading.Event(), threading.Event()]
        self.waiting: dict[int, socket.socket] = {}
        self.dialed = [False, False]  # end i, sent away, has connected back

    def abandon(self, index: int) -> None:
        """End ``index`` was sent to a process that ended: if it never connected,
        its peer sees end-of-file instead of waiting forever."""
        other = 1 - index
        with self.lock:
            if self.dialed[index]:
                return
            self.dialed[index] = True
            if not self.sent[other]:
                a, b = socket.socketpair()
                b.close()
                self.socks[other] = a
                self.arrived[other].set()
            elif other in self.waiting:
                self.waiting.pop(other).close()


class PipeEnd(Connection):
    """One end of a :func:`Pipe`. It connects on first use, wherever it is."""

    def __init__(self, hub: str, pipe_id: str, index: int,
                 readable: bool, writable: bool, state: _PipeState | None) -> None:
        super().__init__(None, readable, writable)
        self._hub = hub
        self._pipe_id = pipe_id
        self._index = index
        self._state = state  # set only in the creating process

    def __reduce__(self) -> tuple:
        if self._sock is not None or self._closed:
            raise PicklingError(
                "a Pipe end can be sent to another process only before it is used or closed here"
            )
        if self._state is not None:
            with self._state.lock:
                self._state.sent[self._index] = True

            run = pickling_for()
            if run is not None:
                state, index = self._state, self._index
                run.on_finish(lambda: state.abandon(index))

        hub = outgoing_addresses(self._hub) if self._state is not None else self._hub
        return (_rebuild_pipe_end, (hub, self._pipe_id, self._index, self._readable, self._writable))

    def _socket(self) -> socket.socket:
        if self._closed:
            raise OSError("handle is closed")
        if self._sock is None:
            self._sock = self._connect()
        return self._sock

    def _connect(self, timeout: float | None = None) -> socket.socket:
        state = self._state
        if state is None:  # this end was sent here: dial the creator

            return dial(self._hub, runtime().authkey, f"pipe:{self._pipe_id}:{self._index}")
        other = 1 - self._index
        with state.lock:
            if state.sent[self._index]:  # its socket went with it: waiting here would hang
                raise OSError("this Pipe end was sent to another process; use it there, not here")
            if state.socks[self._index] is None and not state.sent[other]:
                a, b = socket.socketpair()
                state.socks[self._index], state.socks[other] = a, b
                state.arrived[0].set()
                state.arrived[1].set()
        if not state.arrived[self._index].wait(timeout):
            raise TimeoutError
        sock = state.socks[self._index]
        assert sock is not None
        return sock

    def poll(self, timeout: float | None = 0.0) -> bool:
        self._check_readable()
        if self._sock is None and self._state is not None:
            start = time.monotonic()
            try:
                self._sock = self._connect(timeout)
            except TimeoutError:
                return False
            if timeout is not None:
                timeout = max(0.0, timeout - (time.monotonic() - start))
        return super().poll(timeout)


def _rebuild_pipe_end(hub: str, pipe_id: str, index: int, readable: bool, writable: bool) -> PipeEnd:
    end = PipeEnd(hub, pipe_id, index, readable, writable, None)
    # Connect at once, so that the creator sees EOF if this process dies later.
    end._sock = end._connect()
    return end


def _pipe_route(state: _PipeState, target: str, sock: socket.socket) -> None:
    index = int(target.rsplit(":", 1)[1])
    other = 1 - index
    with state.lock:
        if state.dialed[index]:  # a second copy of the same end, or one given up on
            sock.close()
            return
        state.dialed[index] = True
        if not state.sent[other]:
            state.socks[other] = sock
            state.arrived[other].set()
            return
        if other in state.waiting:
            peer = state.waiting.pop(other)
        else:
            state.waiting[index] = sock
            return
    _splice(sock, peer)


def _splice(a: socket.socket, b: socket.socket) -> None:
    """Relay bytes both ways between two sockets (both ends of a Pipe left the creator)."""

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    threading.Thread(target=pump, args=(a, b), daemon=True, name="fiber-pipe-relay").start()
    threading.Thread(target=pump, args=(b, a), daemon=True, name="fiber-pipe-relay").start()


def Pipe(duplex: bool = True) -> tuple[PipeEnd, PipeEnd]:
    """Return a pair of connected ends, like :func:`multiprocessing.Pipe`.

    The ends can be given to any processes of the program, on any host. When both
    ends stay in one process they are a local socket pair; when one end is sent to
    a child, the child connects straight to this process.
    """

    rt = runtime()
    pipe_id = os.urandom(16).hex()
    state = _PipeState()
    rt.hub.register_prefix(f"pipe:{pipe_id}:", lambda target, sock: _pipe_route(state, target, sock))
    a = PipeEnd(rt.hub.addresses, pipe_id, 0, True, duplex, state)
    b = PipeEnd(rt.hub.addresses, pipe_id, 1, duplex, True, state)
    return a, b
