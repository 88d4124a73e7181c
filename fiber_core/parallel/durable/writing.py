"""What every kind of journal does once open: its replay, its periodic commit, stopping when it cannot write.

:class:`OpenJournal` is the base of the journal in a directory
(:class:`~fiber_core.parallel.durable.journal.Journal`) and of the one in object storage
(:class:`~fiber_core.parallel.durable.stored.StoredJournal`): each says how a record is
appended, what a commit does (``fsync``, or writing a segment) and what it lets go at
the end; the lines a user sees when a journal stops recording are written here only.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Any

from fiber_core.base.log import log
from fiber_core.parallel.durable.replay import Recorded, Replay


class OpenJournal(ABC):
    """A journal open for this run: what was recorded (its replay), and records appended."""

    COMMIT_SECONDS = 0.5
    """How often what was appended is committed (a group commit)."""

    def __init__(self, where: str) -> None:
        self.path = where
        self._lock = threading.Lock()  # the appends, the commits, broken
        self._closed = threading.Event()
        self.broken: str | None = None  # why records are no longer written
        self.written = 0  # UNITS records appended in this run
        self.lease: Any = None
        self.seed = 0
        self.recorded = Recorded()
        self.replay = Replay(self.recorded)
        self.replay_lock = threading.Lock()  # the caller's thread and imap's feeders ask it
        self._committer: threading.Thread | None = None

    def _opened(self, recorded: Recorded, seed: int) -> None:
        """What was read back: the replay starts from it, and the commits begin."""
        self.recorded, self.seed = recorded, seed
        self.replay = Replay(recorded)
        self._committer = threading.Thread(target=self._commit_loop, daemon=True,
                                           name="fiber-journal-commit")
        self._committer.start()

    @abstractmethod
    def append(self, record: bytes) -> None:
        """Add one record (lock not held); a failure calls :meth:`_stop`."""

    @abstractmethod
    def commit(self) -> None:
        """Make what was appended durable (lock not held)."""

    @abstractmethod
    def _release(self) -> None:
        """Let go of what the journal holds open, after its last commit and its lease."""

    def _commit_loop(self) -> None:
        while not self._closed.wait(self.COMMIT_SECONDS):
            self.commit()

    def _stop(self, why: str) -> None:
        """Records can no longer be written (lock held): the run goes on without them."""
        if self.broken is None:
            self.broken = why
            log.warning("fiber: the journal at %s cannot be written (%s): the run goes on without it; "
                        "what it did not record runs again after a restart", self.path, why)

    def _lost(self, holder: str) -> None:
        """Another master took the lease: this one stops writing (one writer at a time)."""
        with self._lock:
            if self.broken is None:
                self.broken = "its lease was taken"
                log.error("fiber: the journal at %s: another master took its lease (%s): this one "
                          "goes on without recording", self.path, holder)

    def close(self) -> None:
        """Commit what was appended, and let the lease go (at the program's exit)."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._committer is not None:
            self._committer.join()
        self.commit()
        self.lease.release()
        self._release()
