"""The journal's I/O, and the program's sequence of calls: what the Pool asks when a call begins and ends.

:func:`program` is this process's :class:`Program`: it numbers the Pool and executor
calls the program makes (their *ordinal*), knows the run's seed, and, with the
``journal`` setting, holds the :class:`Journal`: the directory's lease, the records read
back at the start (a :class:`~fiber_core.parallel.durable.replay.Replay` of them) and the
file that new records are appended to. A call's :class:`CallKey` is what the Pool keeps
for it: its ordinal and the recorded units it may take; the Pool tells it which units
finished (:meth:`CallKey.finished`), one record per batch of results.

Records reach the file with one ``write`` each, from the thread that made them (the
master's, a caller's for a call's identity): a master killed at any moment loses only
what it had not delivered yet, and a torn last record is cut off at the next start. A
thread makes them durable on disk (``fsync``) every half second at most (a group commit). A
write that fails (a full disk) stops the journal with one warning; the run goes on,
and what it did not record runs again after a restart.
"""

from __future__ import annotations

import errno
import functools
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from types import FunctionType
from typing import Any

from fiber_core.base.errors import ForeignObjectError, JournalError
from fiber_core.base.log import log
from fiber_core.base.owned import NOFOLLOW, check
from fiber_core.parallel.durable import records
from fiber_core.parallel.durable.lease import Lease
from fiber_core.parallel.durable.records import CallIdentity, digest
from fiber_core.parallel.durable.replay import Recorded
from fiber_core.parallel.durable.stored import StoredJournal
from fiber_core.parallel.durable.writing import OpenJournal
from fiber_core.runtime.config import config, plugins
from fiber_core.runtime.run import runtime
from fiber_core.wire.serialize import dumps, fingerprint

NAME = "journal"
"""The records' file in the journal's directory."""


NOTEBOOK_NAMES = ("__session__", "__vsc_ipynb_file__")
"""Where a notebook's kernel keeps the notebook's path in its namespace (``__main__``):
ipykernel from ``JPY_SESSION_NAME``, which Jupyter's server sets; VS Code's own name."""


def name_program(setting: str | None, main: object) -> str:
    """The name of the program a journal belongs to: the ``program`` setting if given, else
    the real path of the main module ``main``'s file, else the path of the notebook its
    kernel runs (:data:`NOTEBOOK_NAMES`). Its source is not part of it: a changed program
    replays the calls that did not change (each call's identity says which).

    Without any (a kernel that does not know its notebook, ``python -c``, a console), a
    :class:`JournalError` that says what to set: every such program would otherwise be the
    same one, and one's journal would be replayed (and voided) by another's."""
    if setting:
        return setting
    path = getattr(main, "__file__", None)
    if path:
        return os.path.realpath(path)
    for attr in NOTEBOOK_NAMES:
        notebook = getattr(main, attr, None)
        if isinstance(notebook, str) and notebook:
            return os.path.realpath(notebook) if os.path.isabs(notebook) else notebook
    raise JournalError(
        "a journal needs to know which program it belongs to, and this one has no file (a "
        "notebook whose kernel does not know the notebook's path, python -c, a console): name "
        'it with the program setting, fiber_core.init(journal=..., program="my-analysis") or '
        "FIBER_PROGRAM=my-analysis, the same name each time it runs")


def program_name() -> str:
    """The name of this process's program (:func:`name_program`)."""
    return name_program(config.get("program"), sys.modules.get("__main__"))


def function_digest(func: Callable, func_bytes: bytes) -> bytes:
    """A digest of what a function does: for a Python function its module, qualified name,
    code and the values it closes over (its pickle may differ between runs: a set among
    its constants follows the string hashes), for a ``partial`` its function and arguments,
    for anything else its pickle."""
    if isinstance(func, functools.partial):
        inner = function_digest(func.func, dumps(func.func))
        return digest(inner + dumps((func.args, func.keywords)))
    if isinstance(func, FunctionType):
        cells = tuple(c.cell_contents for c in func.__closure__ or ())
        return digest(func.__module__.encode() + b"\0" + fingerprint(func)
                      + dumps((cells, func.__defaults__, func.__kwdefaults__)))
    return digest(func_bytes)


class Journal(OpenJournal):
    """A journal directory, open for this run: its lease held, its records read and appended to."""

    def __init__(self, path: str, program: str, wait: float, seed: int | None) -> None:
        super().__init__(os.path.abspath(path))
        self._dirty = False
        self._dir = self._open_dir()
        self.lease = Lease(self._dir, self.path, self._lost)
        try:
            self.lease.acquire(wait)
        except BaseException:
            os.close(self._dir)
            raise
        try:
            recorded, run_seed, self._fd = self._open_file(program, seed)
        except BaseException:
            self.lease.release()
            os.close(self._dir)
            raise
        self._opened(recorded, run_seed)

    def _open_dir(self) -> int:
        try:
            os.makedirs(self.path, 0o700, exist_ok=True)
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW)
        except OSError as e:
            raise JournalError(f"cannot use {self.path} as the journal's directory: {e.strerror or e}; "
                               "set journal to a directory this user can write") from e
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            os.close(fd)
            raise ForeignObjectError(
                f"the journal's directory {self.path} is not this user's, or others may write in "
                "it: what it holds is unpickled, so it must be yours alone (chmod go-w)")
        return fd

    def _open_file(self, program: str, seed: int | None) -> tuple[Recorded, int, int]:
        """Read the records back, cut a torn or damaged tail, set aside another program's
        journal; return what was recorded, the run's seed and the descriptor to append to."""
        recorded = Recorded()
        try:
            fd = os.open(NAME, os.O_RDWR | NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir)
        except FileNotFoundError:
            return recorded, *self._create(program, seed)
        try:
            check(fd, f"the journal {self.path}/{NAME}", private=False)
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read()
        except BaseException:
            os.close(fd)
            raise
        if not data:  # made by a run that could not write its header (a full disk): start again
            os.close(fd)
            os.unlink(NAME, dir_fd=self._dir)
            return recorded, *self._create(program, seed)
        scan = records.scan(data)
        why = records.foreign(scan, program, seed)
        if why is not None:
            os.close(fd)
            aside = f"{NAME}.set-aside-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}"
            os.rename(NAME, aside, src_dir_fd=self._dir, dst_dir_fd=self._dir)
            log.warning("fiber: the journal at %s %s: set aside as %s; this run starts a new one "
                        "and runs everything", self.path, why, aside)
            return recorded, *self._create(program, seed)
        run_seed = records.read_header(scan.records[0][1])["seed"]
        try:
            for kind, payload in scan.records[1:]:
                recorded.add(kind, payload)
        except Exception as e:  # a checksum-valid record that does not load: written by a bug
            raise JournalError(f"the journal at {self.path} holds a record that cannot be read "
                               f"({e!r}): remove it ({self.path}/{NAME}) to start afresh") from e
        if scan.problem is not None:
            log.warning("fiber: the journal at %s: %s; it and the %d bytes after it are dropped, "
                        "and their work runs again", self.path, scan.problem, len(data) - scan.good)
            os.ftruncate(fd, scan.good)
        os.lseek(fd, 0, os.SEEK_END)
        calls, units = recorded.counts()
        log.info("fiber: the journal at %s holds %d calls, %d finished units: they are replayed "
                 "while the program makes the same calls", self.path, calls, units)
        return recorded, run_seed, fd

    def _create(self, program: str, seed: int | None) -> tuple[int, int]:
        run_seed = seed if seed is not None else int.from_bytes(os.urandom(8), "big")
        fd = os.open(NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL | NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=self._dir)
        data = records.MAGIC + records.header(program, run_seed)
        try:
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            os.fsync(fd)
        except OSError:
            os.close(fd)
            os.unlink(NAME, dir_fd=self._dir)
            raise
        return run_seed, fd

    def append(self, record: bytes) -> None:
        """Write one record now (to the OS; made durable by the next commit)."""
        with self._lock:
            if self.broken is not None or self._closed.is_set():
                return  # (a result that arrives while the program exits: it runs again)
            try:
                view = memoryview(record)
                while view:
                    view = view[os.write(self._fd, view):]
            except OSError as e:
                self._stop(e.strerror or str(e))
                return
            self._dirty = True

    def commit(self) -> None:
        with self._lock:
            if not self._dirty or self.broken is not None:
                return
            self._dirty = False
            try:
                os.fsync(self._fd)
            except OSError as e:
                self._stop(e.strerror or str(e))

    def _release(self) -> None:
        os.close(self._fd)
        os.close(self._dir)


def open_journal(path: str, wait: float, seed: int | None) -> Journal | StoredJournal:
    """The journal the setting names: a directory, or object storage a plugin opens (``s3://``)."""
    program = program_name()  # (before anything is opened: it may be refused)
    if "://" not in path:
        return Journal(path, program, wait, seed)
    store = plugins().journal_store(path)
    if store is None:
        raise JournalError(
            f"journal={path!r}: no installed plugin serves this kind of storage (s3:// needs "
            "fiber-aws: pip install fiber-aws); or set journal to a local directory or one on a "
            "mounted volume that outlives the master")
    return StoredJournal(store, program, wait, seed)


class CallKey:
    """What the Pool keeps of a call for the journal: its ordinal, and what may be replayed."""

    __slots__ = ("ordinal", "seed", "identity", "journal", "digests", "replayed", "checked")

    def __init__(self, ordinal: int, seed: int, identity: CallIdentity | None = None,
                 journal: Journal | StoredJournal | None = None) -> None:
        self.ordinal = ordinal
        self.seed = seed  # the run's, sent with each batch (the task's seed comes from it)
        self.identity = identity
        self.journal = journal
        self.digests: dict[int, bytes] = {}  # unit index -> digest of its pickled arguments
        self.replayed: dict[int, tuple[bytes, Any]] = {}  # recorded: unit index -> (digest, values)
        self.checked = True  # False for imap: each unit's arguments are checked as it comes

    def take(self, index: int, data: bytes) -> tuple[bool, Any]:
        """Unit ``index`` with pickled arguments ``data`` is about to be queued: ``(True,
        values)`` if the journal holds its result (it is not run), else ``(False, None)``.

        A call whose identity covers its whole input and its cut into units needs no check
        per unit (nor a digest of each: the journal's cost on a map of many small units)."""
        if self.journal is None:
            return False, None
        if self.checked:
            got = self.replayed.pop(index, None)
            return (True, got[1]) if got is not None else (False, None)
        d = self.digests[index] = digest(data)
        assert self.identity is not None
        with self.journal.replay_lock:
            ok, values, warning = self.journal.replay.unit(self.identity, index, d)
        if warning is not None:  # this call went another way: what it recorded is void
            log.warning("%s", warning)
            self.journal.append(records.truncate(self.ordinal))
            self.journal.append(records.call(self.identity))
        return ok, values

    def finished(self, done: list[tuple[int, Any]]) -> None:
        """Units finished (``(index, values)``, in the master thread): one record."""
        journal = self.journal
        if journal is None or journal.broken is not None or not done:
            return
        try:
            digests = self.digests
            record = records.units(self.ordinal, [(i, digests.get(i, b"")) for i, _ in done],
                                   [values for _, values in done])
        except Exception as e:  # a value that cannot be pickled here: it runs again after a restart
            log.debug("fiber: a result of call %d is not journalled: %r", self.ordinal, e)
            return
        journal.append(record)
        journal.written += 1


def settings_changed(opened: tuple[Any, Any], now: tuple[Any, Any]) -> str:
    """What a program is told when its ``journal`` or ``program`` setting changed after its
    first Pool or executor call (``(journal, program)`` then and now)."""
    key, was, value = next((k, a, b) for k, a, b in zip(("journal", "program"), opened, now) if a != b)
    return (f"{key} was set to {value!r} after this program's first Pool or executor call "
            f"(it was {was!r} then), and a journal records a program from its start: set it before "
            "the first call, and start the program again (in a notebook: in its first cell, then "
            "restart the kernel)")


class Program:
    """This process's sequence of Pool and executor calls, and its journal if one is set."""

    def __init__(self, without_journal: bool = False) -> None:
        """``without_journal``: this process records nothing (a child forked by other code)."""
        self._lock = threading.Lock()
        self._next = 0
        self._resolved = without_journal
        self.journal: Journal | StoredJournal | None = None
        self.seed = 0
        self._settings: tuple[Any, Any] | None = None  # (journal, program) as opened
        self._generation = -1  # the settings' generation when they were last compared

    def _ready(self) -> None:
        """Resolve the journal on the first call; on a later one, refuse a journal or
        program setting that changed since (it would be ignored: the journal records the
        program from its start)."""
        if not self._resolved:
            self._resolve()
        elif self._settings is not None and config.generation != self._generation:
            self._generation = config.generation
            now = (config.get("journal"), config.get("program"))
            if now != self._settings:
                raise JournalError(settings_changed(self._settings, now))

    def _resolve(self) -> None:
        """Open the journal (and take its lease) on the program's first call. One that is
        refused (no program name, another master holds it) is asked for again at the next
        call, so that a notebook that then sets what the error said gets its journal."""
        self._generation = config.generation
        self._settings = (config.get("journal"), config.get("program"))
        seed = config.get("seed")
        path = self._settings[0]
        self.seed = seed if seed is not None else int.from_bytes(os.urandom(8), "big")
        if path and not runtime().is_worker:  # a job's calls are its master's business
            try:
                self.journal = open_journal(path, config.get("journal_wait"), seed)
            except OSError as e:
                if isinstance(e, PermissionError):  # (ForeignObjectError, a directory not ours)
                    raise
                self._resolved = True
                log.warning("fiber: the journal at %s cannot be written (%s): the run goes on without "
                            "it; what it did not record runs again after a restart",
                            os.path.abspath(path), e.strerror or e)
                return
            runtime().at_shutdown(self.journal.close)
            self.seed = self.journal.seed
        self._resolved = True

    @property
    def journalled(self) -> bool:
        """Whether this program has a journal (it is opened on the first question)."""
        with self._lock:
            self._ready()
            return self.journal is not None

    def begin(self, name: str, func: Callable, func_bytes: bytes,
              args: Callable[[], bytes] | None) -> CallKey:
        """A call begins: its key, with what the journal recorded for it. ``args`` gives its
        pickled arguments as a whole (asked only with a journal), or is None where they come
        unit by unit (``imap``)."""
        with self._lock:
            self._ready()
            ordinal = self._next
            self._next += 1
            journal = self.journal
            if journal is None:
                return CallKey(ordinal, self.seed)
            identity = CallIdentity(ordinal, name, function_digest(func, func_bytes),
                                    b"" if args is None else digest(args()))
            key = CallKey(ordinal, self.seed, identity, journal)
            key.checked = args is not None
            with journal.replay_lock:
                verdict = journal.replay.begin(identity)
            if verdict.warning is not None:
                log.warning("%s", verdict.warning)
            if verdict.truncate:
                journal.append(records.truncate(ordinal))
            if journal.replay.active:  # the same call as recorded: its record is there
                key.replayed = dict(verdict.units)
            else:
                journal.append(records.call(identity))
            return key


_program: Program | None = None
_program_lock = threading.Lock()


def program() -> Program:
    """This process's :class:`Program`, made on first use."""
    global _program
    with _program_lock:
        if _program is None:
            _program = Program()
        return _program


def _forked() -> None:
    """A child forked by other code (multiprocessing with fork) is no master of the journal:
    its calls are numbered from 0 and recorded nowhere."""
    global _program, _program_lock
    _program_lock = threading.Lock()
    _program = Program(without_journal=True)
    _program.seed = int.from_bytes(os.urandom(8), "big")


os.register_at_fork(after_in_child=_forked)


def args_bytes(items: Any) -> bytes:
    """The pickle of a call's whole input, for its identity (``pickle``: plain data pickles
    the same in every run; what cannot is cloudpickled)."""
    try:
        return pickle.dumps(items, pickle.HIGHEST_PROTOCOL)
    except Exception:
        return dumps(items)
