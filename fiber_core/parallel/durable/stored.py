"""A journal in object storage (``journal = s3://bucket/prefix``): its records in append-only segments.

Object storage has no append: the records are buffered and written every
:data:`SEGMENT_SECONDS` as a new object ``journal/<n>`` (a group commit; a master killed
loses what it had buffered, at most that long of results, which run again). A *base*
segment (``journal/<n>.base``) holds everything before it: a reader starts at the
newest base and reads the segments after it in order. At each start the master
writes what it read (cut before a damaged record) as a new base and then removes the
older segments, so a crash in between leaves nothing that is read twice. The lease is
an object of the store (:class:`~fiber_core.parallel.durable.lease.StoreLease`).
"""

from __future__ import annotations

import os
import time

from fiber_core.base.log import log
from fiber_core.contract.store import ObjectStore
from fiber_core.parallel.durable import records
from fiber_core.parallel.durable.lease import StoreLease
from fiber_core.parallel.durable.replay import Recorded
from fiber_core.parallel.durable.writing import OpenJournal

SEGMENT_SECONDS = 0.5
"""How often buffered records are written as a segment: a request per this long at most."""

PREFIX = "journal/"


def segment_order(names: list[str]) -> list[str]:
    """The segments a reader reads, in order: the newest base and those after it."""
    numbered = sorted((int(name[len(PREFIX):].split(".")[0]), name) for name in names
                      if name.startswith(PREFIX) and name[len(PREFIX):].split(".")[0].isdigit())
    start = max((i for i, (_, name) in enumerate(numbered) if name.endswith(".base")), default=0)
    return [name for _, name in numbered[start:]]


def segment_number(name: str) -> int:
    return int(name[len(PREFIX):].split(".")[0])


class StoredJournal(OpenJournal):
    """A journal in an :class:`ObjectStore`, open for this run (as :class:`Journal` is for a directory)."""

    COMMIT_SECONDS = SEGMENT_SECONDS

    def __init__(self, store: ObjectStore, program: str, wait: float, seed: int | None) -> None:
        super().__init__(store.where)
        self._store = store
        self._buffer: list[bytes] = []
        self.lease = StoreLease(store, self._lost)
        self.lease.acquire(wait)
        try:
            recorded, run_seed = self._open(program, seed)
        except BaseException:
            self.lease.release()
            raise
        self._opened(recorded, run_seed)

    def _open(self, program: str, seed: int | None) -> tuple[Recorded, int]:
        """Read the segments back; write them as one base (cut before a damaged record, or a new
        journal in place of another program's); return what was recorded and the run's seed."""
        old = self._store.names(PREFIX)
        names = segment_order(old)
        parts = []
        for name in names:
            got = self._store.get(name)
            parts.append(got[0] if got is not None else b"")
        data = b"".join(parts)
        self._next = max((segment_number(n) for n in old if n.startswith(PREFIX)
                          and n[len(PREFIX):].split(".")[0].isdigit()), default=-1) + 1
        recorded = Recorded()
        scan = records.scan(data)
        why = records.foreign(scan, program, seed) if data else "is empty"
        if why is not None:
            if data:
                aside = f"set-aside-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
                self._store.put(aside, data)
                log.warning("fiber: the journal at %s %s: set aside as %s; this run starts a new one "
                            "and runs everything", self.path, why, aside)
            run_seed = seed if seed is not None else int.from_bytes(os.urandom(8), "big")
            good = records.MAGIC + records.header(program, run_seed)
        else:
            run_seed = records.read_header(scan.records[0][1])["seed"]
            for kind, payload in scan.records[1:]:
                recorded.add(kind, payload)
            if scan.problem is not None:
                log.warning("fiber: the journal at %s: %s; it and the %d bytes after it are dropped, "
                            "and their work runs again", self.path, scan.problem, len(data) - scan.good)
            good = data[:scan.good]
        if why is not None or len(names) != 1 or not names[0].endswith(".base") or scan.problem:
            base = f"{PREFIX}{self._next:012d}.base"
            self._store.put(base, good)
            self._next += 1
            for name in old:  # (after the base: a crash here leaves them unread)
                if name.startswith(PREFIX) and name != base:
                    self._store.delete(name)
        return recorded, run_seed

    def append(self, record: bytes) -> None:
        with self._lock:
            if self.broken is None and not self._closed.is_set():
                self._buffer.append(record)

    def commit(self) -> None:
        """Write what is buffered as the next segment."""
        with self._lock:
            if not self._buffer or self.broken is not None:
                return
            data, self._buffer = b"".join(self._buffer), []
            name = f"{PREFIX}{self._next:012d}"
            self._next += 1
        try:
            self._store.put(name, data)
        except OSError as e:
            with self._lock:
                self._stop(str(e))

    def _release(self) -> None:
        pass  # nothing is held open: each request stands alone
