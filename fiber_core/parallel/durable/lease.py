"""One master at a time on a journal: a lease, renewed while its holder runs.

The lease (``lease`` beside the journal's records) names its holder (pid, host, a
token) and when it runs out. A master takes it when there is none, when it has run out
(its holder stopped renewing it: dead, or cut off), or at once when its holder is a
process of this host that no longer exists. The holder renews it every
:data:`RENEW_SECONDS` and removes it at exit; one that finds it taken when it renews is
told (``on_lost``). :class:`LeaseBase` holds these rules; :class:`Lease` keeps the lease
as a file (taking a stale one renames it away first: of two masters that race for it,
only one rename succeeds), :class:`StoreLease` as an object of an
:class:`~fiber_core.contract.store.ObjectStore` (written only if absent, renewed only if
unchanged, removed only in the version that ran out).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from fiber_core.base.errors import JournalBusyError
from fiber_core.base.log import log
from fiber_core.base.owned import NOFOLLOW, check
from fiber_core.contract.store import ObjectStore

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


class LeaseBase(ABC):
    """The lease's rules; a subclass says how the lease is kept."""

    def __init__(self, where: str, on_lost: Callable[[str], None]) -> None:
        self._where = where
        self._on_lost = on_lost  # told who took the lease: the holder must stop writing
        self._host = socket.gethostname()
        self._token = os.urandom(8).hex()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _mine(self) -> bytes:
        return json.dumps({"pid": os.getpid(), "host": self._host, "token": self._token,
                           "expires": time.time() + LEASE_SECONDS}).encode()

    @staticmethod
    def _parse(data: bytes) -> dict[str, Any]:
        try:
            holder = json.loads(data)
        except ValueError:
            return {}  # half written by a holder killed then: it has no expiry, so it ran out
        return holder if isinstance(holder, dict) else {}

    @abstractmethod
    def _create(self) -> bool:
        """Write this master's lease if there is none; False if there is one."""

    @abstractmethod
    def _holder(self) -> tuple[dict[str, Any], Any] | None:
        """The lease there is (and what tells its version), or None."""

    @abstractmethod
    def _remove(self, holder: dict[str, Any], version: Any) -> bool:
        """Remove the lease of that holder, if it is still the one there (False otherwise)."""

    @abstractmethod
    def _rewrite(self) -> bool:
        """Write this master's lease again if it is still this master's (False otherwise)."""

    @abstractmethod
    def _drop(self) -> None:
        """Remove this master's lease, if it still is."""

    def acquire(self, wait: float) -> None:
        """Take the lease, waiting up to ``wait`` seconds while another master holds it."""
        give_up = time.monotonic() + wait
        while not self._create():
            got = self._holder()
            if got is None:
                continue  # its holder let it go meanwhile
            holder, version = got
            why = holder_gone(holder, time.time(), self._host)
            if why is not None:
                if self._remove(holder, version):
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
        while not self._stop.wait(RENEW_SECONDS) and self.renew():
            pass

    def renew(self) -> bool:
        """Push the lease's end back; False (and ``on_lost`` told) if it is no longer this one's."""
        try:
            if self._rewrite():
                return True
            got = self._holder()
        except OSError as e:
            log.warning("fiber: the journal at %s: cannot renew its lease: %s", self._where, e)
            return True
        # (this process stalled past its lease: another master runs the program now)
        self._on_lost(describe(got[0]) if got is not None else "no lease is left")
        return False

    def release(self) -> None:
        """Let the lease go (at exit): the next master takes it at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            try:
                self._drop()
            except OSError:
                pass


class Lease(LeaseBase):
    """The lease as the file ``lease`` of the journal's directory."""

    def __init__(self, dir_fd: int, where: str, on_lost: Callable[[str], None]) -> None:
        super().__init__(where, on_lost)
        self._dir = dir_fd

    def _read(self) -> dict[str, Any] | None:
        return self._read_as(NAME)

    def _read_as(self, name: str) -> dict[str, Any] | None:
        try:
            fd = os.open(name, os.O_RDONLY | NOFOLLOW, dir_fd=self._dir)
        except FileNotFoundError:
            return None
        try:
            check(fd, f"the lease of the journal at {self._where}", private=False)
            data = os.read(fd, 4096)
        finally:
            os.close(fd)
        return self._parse(data)

    def _create(self) -> bool:
        try:
            fd = os.open(NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600, dir_fd=self._dir)
        except FileExistsError:
            return False
        try:
            os.write(fd, self._mine())
        finally:
            os.close(fd)
        return True

    def _holder(self) -> tuple[dict[str, Any], Any] | None:
        holder = self._read()
        return None if holder is None else (holder, None)

    def _remove(self, holder: dict[str, Any], version: Any) -> bool:
        stale = f"{NAME}.stale-{self._token}"
        try:
            os.rename(NAME, stale, src_dir_fd=self._dir, dst_dir_fd=self._dir)
        except FileNotFoundError:
            return False  # another master took it away first
        taken = self._read_as(stale)
        if taken is not None and taken.get("token") != holder.get("token"):
            try:  # a fresh lease came between the look and the rename: it goes back
                os.link(stale, NAME, src_dir_fd=self._dir, dst_dir_fd=self._dir)
            except FileExistsError:
                pass
            os.unlink(stale, dir_fd=self._dir)
            return False
        os.unlink(stale, dir_fd=self._dir)
        return True

    def _rewrite(self) -> bool:
        holder = self._read()
        if holder is None or holder.get("token") != self._token:
            return False
        tmp = f"{NAME}.{self._token}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | NOFOLLOW, 0o600, dir_fd=self._dir)
        try:
            os.write(fd, self._mine())
        finally:
            os.close(fd)
        os.replace(tmp, NAME, src_dir_fd=self._dir, dst_dir_fd=self._dir)
        return True

    def _drop(self) -> None:
        holder = self._read()
        if holder is not None and holder.get("token") == self._token:
            os.unlink(NAME, dir_fd=self._dir)


class StoreLease(LeaseBase):
    """The lease as the object ``lease`` of an :class:`ObjectStore`, by its version tags."""

    def __init__(self, store: ObjectStore, on_lost: Callable[[str], None]) -> None:
        super().__init__(store.where, on_lost)
        self._store = store
        self._tag: str | None = None

    def _create(self) -> bool:
        self._tag = self._store.put(NAME, self._mine(), if_absent=True)
        return self._tag is not None

    def _holder(self) -> tuple[dict[str, Any], Any] | None:
        got = self._store.get(NAME)
        return None if got is None else (self._parse(got[0]), got[1])

    def _remove(self, holder: dict[str, Any], version: Any) -> bool:
        return self._store.delete(NAME, if_tag=version)

    def _rewrite(self) -> bool:
        tag = self._store.put(NAME, self._mine(), if_tag=self._tag)
        if tag is None:
            return False
        self._tag = tag
        return True

    def _drop(self) -> None:
        self._store.delete(NAME, if_tag=self._tag)
