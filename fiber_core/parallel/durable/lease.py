"""One master at a time on a journal: a lease file, renewed while its holder runs.

The lease (``lease`` in the journal's directory) names its holder (pid, host, a
token) and when it runs out. A master takes it when there is none, when it has run out
(its holder stopped renewing it: dead, or cut off), or at once when its holder is a
process of this host that no longer exists. Taking a stale lease renames it away
first: of two masters that race for it, only one rename succeeds. The holder renews
it every :data:`RENEW_SECONDS` and removes it at exit.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from fiber_core.base.errors import JournalBusyError
from fiber_core.base.log import log
from fiber_core.base.owned import NOFOLLOW, check

LEASE_SECONDS = 15.0
"""How long a lease holds without renewal: a holder on another host that died (or lost
its network) keeps the next master waiting this long at most."""

RENEW_SECONDS = 5.0
"""How often the holder renews: three tries before the lease runs out."""

POLL_SECONDS = 0.25
"""How often a master that waits for a lease (``journal_wait``) looks at it again."""

NAME = "lease"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def holder_gone(holder: dict[str, Any], now: float, host: str,
                alive: Callable[[int], bool] = pid_alive) -> str | None:
    """Why the lease of ``holder`` no longer holds (None: it does): run out, or its holder
    was a process of this host that no longer exists."""
    expires = holder.get("expires")
    if not isinstance(expires, (int, float)) or now >= expires:
        return "it ran out"
    pid = holder.get("pid")
    if holder.get("host") == host and isinstance(pid, int) and not alive(pid):
        return f"its holder, pid {pid} of this host, has ended"
    return None


def describe(holder: dict[str, Any]) -> str:
    until = time.strftime("%H:%M:%S UTC", time.gmtime(holder.get("expires", 0)))
    return f"pid {holder.get('pid')} on host {holder.get('host')} (its lease runs until {until})"


class Lease:
    """The journal's lease, taken by :meth:`acquire`, renewed by a thread, let go by :meth:`release`."""

    def __init__(self, dir_fd: int, where: str) -> None:
        self._dir = dir_fd
        self._where = where
        self._host = socket.gethostname()
        self._token = os.urandom(8).hex()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _mine(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": self._host, "token": self._token,
                "expires": time.time() + LEASE_SECONDS}

    def _read(self) -> dict[str, Any] | None:
        try:
            fd = os.open(NAME, os.O_RDONLY | NOFOLLOW, dir_fd=self._dir)
        except FileNotFoundError:
            return None
        try:
            check(fd, f"the lease of the journal at {self._where}", private=False)
            data = os.read(fd, 4096)
        finally:
            os.close(fd)
        try:
            holder = json.loads(data)
        except ValueError:
            return {}  # half written by a holder killed then: it has no expiry, so it ran out
        return holder if isinstance(holder, dict) else {}

    def _write_new(self) -> bool:
        try:
            fd = os.open(NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600, dir_fd=self._dir)
        except FileExistsError:
            return False
        try:
            os.write(fd, json.dumps(self._mine()).encode())
        finally:
            os.close(fd)
        return True

    def acquire(self, wait: float) -> None:
        """Take the lease, waiting up to ``wait`` seconds while another master holds it."""
        give_up = time.monotonic() + wait
        while True:
            if self._write_new():
                break
            holder = self._read()
            if holder is None:
                continue  # its holder let it go meanwhile
            why = holder_gone(holder, time.time(), self._host)
            if why is not None:
                stale = f"{NAME}.stale-{self._token}"
                try:
                    os.rename(NAME, stale, src_dir_fd=self._dir, dst_dir_fd=self._dir)
                except FileNotFoundError:
                    continue  # another master took it away first
                os.unlink(stale, dir_fd=self._dir)
                log.info("fiber: the journal at %s: took over the lease of %s: %s",
                         self._where, describe(holder), why)
                continue
            if time.monotonic() >= give_up:
                raise JournalBusyError(
                    f"the journal at {self._where} is in use by another master of this program, "
                    f"{describe(holder)}: let it finish or stop it, or set journal_wait (seconds) "
                    "to wait for it")
            time.sleep(POLL_SECONDS)  # another process's lease: no event to wait for
        self._thread = threading.Thread(target=self._renew, daemon=True, name="fiber-journal-lease")
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_SECONDS):
            try:
                holder = self._read()
                if holder is None or holder.get("token") != self._token:
                    log.error("fiber: the journal at %s: another master took its lease (%s); "
                              "this one goes on, and both now write to it", self._where,
                              describe(holder) if holder else "none left")
                    return
                tmp = f"{NAME}.{self._token}"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | NOFOLLOW, 0o600,
                             dir_fd=self._dir)
                try:
                    os.write(fd, json.dumps(self._mine()).encode())
                finally:
                    os.close(fd)
                os.replace(tmp, NAME, src_dir_fd=self._dir, dst_dir_fd=self._dir)
            except OSError as e:
                log.warning("fiber: the journal at %s: cannot renew its lease: %s", self._where, e)

    def release(self) -> None:
        """Let the lease go (at exit): the next master takes it at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            try:
                holder = self._read()
                if holder is not None and holder.get("token") == self._token:
                    os.unlink(NAME, dir_fd=self._dir)
            except OSError:
                pass
