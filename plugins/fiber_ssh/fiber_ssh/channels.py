"""The channels of the jobs on SSH hosts: one :class:`Run` per job (``Job.handle``), and the
reader that follows every channel in one watcher thread (output, exit codes, heartbeats)."""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fiber_core.contract import Job

from fiber_ssh.connect import Host
from fiber_ssh.hosts import Placement

if TYPE_CHECKING:
    import paramiko

log = logging.getLogger("fiber")

EXIT_GRACE = 2.0  # seconds to wait for the rest of a job's log after its exit code
IDLE = 3600.0  # a watcher's pause when only a wake() or a stop() has something for it


@dataclass(eq=False)
class Run:
    """One job's channel and what its supervisor said (``Job.handle``)."""

    host: Host
    index: int
    placement: Placement
    transport: paramiko.Transport
    chan: paramiko.Channel
    pgid: int | None = None  # the job's process group on the host, once it runs
    reported: int | None = None  # the exit code the supervisor reported, and when
    reported_at: float = 0.0
    error: str = ""  # why the supervisor could not start the job
    oom: bool = False  # the supervisor saw the kernel's OOM killer end it
    killed: bool = False  # it saw a SIGKILL it did not send while the OOM-kill count stood still
    ended: bool = False  # its end is recorded (the slots given back), under the backend's lock
    out: bytes = b""

    def feed_out(self, data: bytes) -> None:
        self.out += data
        *lines, self.out = self.out.split(b"\n")
        for line in lines:
            if not line.startswith(b"@fiber "):
                continue  # a login shell's chatter
            kind, _, value = line[7:].decode("utf-8", "replace").partition(" ")
            try:
                if kind == "pid":
                    self.pgid = int(value)
                elif kind == "error":
                    self.error = value
                elif kind == "oom":
                    self.oom = True
                elif kind == "killed":
                    self.killed = True
                elif kind == "exit":
                    self.reported = int(value)
                    self.reported_at = time.monotonic()
            except ValueError:
                pass

    def send(self, command: bytes) -> None:
        try:
            self.chan.send(command)
        except Exception:  # the channel or its connection is gone: nothing to signal
            pass


class Channels:
    """Reads every job's channel and sends the heartbeats, in the ``channels`` watcher.

    :meth:`follow` runs until :meth:`close`, then finishes the jobs it still follows (``finish(job,
    closed)``, the backend's);
    should it fail, the watcher runs it again and it takes up the same jobs.
    """

    def __init__(self, keepalive: float, finish: Callable[[Job, bool], None]) -> None:
        self.finish = finish
        self.interval = max(0.1, float(keepalive))
        self.lock = threading.Lock()
        self.new: list[Job] = []
        self.jobs: set[Job] = set()  # only follow() touches it
        self.closed = False
        self._wake_w: socket.socket | None = None

    def add(self, job: Job) -> None:
        with self.lock:
            self.new.append(job)
            self._wake()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self._wake()

    def _wake(self) -> None:  # holding self.lock
        try:
            if self._wake_w is not None:
                self._wake_w.send(b"x")
        except OSError:
            pass

    def follow(self) -> float:
        wake_r, wake_w = socket.socketpair()
        wake_w.setblocking(False)
        with wake_r, wake_w, selectors.DefaultSelector() as sel:
            sel.register(wake_r, selectors.EVENT_READ, None)
            for job in self.jobs:
                sel.register(job.handle.chan, selectors.EVENT_READ, job)
            with self.lock:
                self._wake_w = wake_w
            try:
                self._loop(sel, wake_r)
            except Exception:
                log.exception("fiber-ssh: reading the jobs' channels failed (it starts again)")
                raise
            finally:
                with self.lock:
                    self._wake_w = None
            for job in list(self.jobs):
                self._read(sel, job)
                if job in self.jobs:
                    self._close(sel, job)
        return IDLE

    def _loop(self, sel: selectors.BaseSelector, wake_r: socket.socket) -> None:
        next_beat = time.monotonic() + self.interval
        while True:
            with self.lock:
                new, self.new = self.new, []
            for job in new:
                self.jobs.add(job)
                sel.register(job.handle.chan, selectors.EVENT_READ, job)
                self._read(sel, job)
            if self.closed:
                return
            now = time.monotonic()
            for job in [j for j in self.jobs if j.handle.reported is not None
                        and now - j.handle.reported_at > EXIT_GRACE]:
                self._close(sel, job)  # its exit code is in; something holds its output open
            if now >= next_beat:
                next_beat = now + self.interval
                for job in self.jobs:
                    if job.handle.chan.send_ready():
                        job.handle.send(b"h\n")
            timeout = next_beat - time.monotonic()
            if any(j.handle.reported is not None for j in self.jobs):
                timeout = min(timeout, EXIT_GRACE / 4)
            for key, _ in sel.select(max(0.0, timeout)):
                if key.data is None:
                    wake_r.recv(4096)
                else:
                    self._read(sel, key.data)

    def _read(self, sel: selectors.BaseSelector, job: Job) -> None:
        if job not in self.jobs:
            return
        chan = job.handle.chan
        closed = chan.closed
        while chan.recv_ready():
            data = chan.recv(65536)
            if not data:
                break
            job.handle.feed_out(data)
        while chan.recv_stderr_ready():
            data = chan.recv_stderr(65536)
            if not data:
                break
            job.state.log.append(data)
        if closed:
            self._close(sel, job)

    def _close(self, sel: selectors.BaseSelector, job: Job) -> None:
        self.jobs.discard(job)
        try:
            sel.unregister(job.handle.chan)
        except (KeyError, ValueError):
            pass
        try:
            job.handle.chan.close()
        except Exception:
            pass
        self.finish(job, self.closed)
