"""The live view of a run: the state a program shows ``fiber top`` and its status page, when asked.

Nothing is exposed unless the program asks for it: ``fiber_core.init(status=True)`` (or
``FIBER_STATUS=1``) for ``fiber top``, ``status_port=`` (``FIBER_STATUS_PORT``) for the
page too, or :func:`fiber_core.serve_status`. Then the run's first process:

* answers STATUS_ASK on its hub (target ``status``) with STATUS_STATE, JSON; the hub's
  handshake has proved by then that the viewer holds the run's key;
* writes :data:`RUN_FILE` (mode 0600) into its run directory (mode 0700, in the user's
  temporary directory): the run id, its pid, the hub's addresses and the run's key. That
  is how ``fiber top`` in another terminal of the same user finds and reaches it, with
  the key on no command line; the file goes with the run directory at exit;
* with the page: serves it on 127.0.0.1 (:mod:`fiber_core.runtime.status_page`), every
  request carrying :func:`page_token`.

Objects with a state to show (pools) call :func:`report`; a snapshot asks each of them
for it (their ``status_snapshot()``) when a viewer asks, and at no other time.
"""

from __future__ import annotations

import errno
import hmac
import json
import os
import socket
import stat
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from fiber_core.base.errors import FiberError
from fiber_core.base.log import log
from fiber_core.runtime.hub import Hub, dial
from fiber_core.wire.framing import Connection
from fiber_core.wire.messages import (
    STATUS_ASK,
    STATUS_STATE,
    MessageError,
    decode_status_state,
    encode_status_state,
    kind_of,
    unexpected,
)

if TYPE_CHECKING:
    from fiber_core.runtime.status_page import StatusPage

TARGET = "status"
"""The hub target a viewer asks for."""

RUN_FILE = "status.json"
"""The file in the run directory that tells ``fiber top`` where the run is and its key."""

RUN_DIR_PREFIX = "fiber-"
"""How the run directories in the temporary directory begin (``fiber-<run id>-...``)."""

_PAGE_LABEL = b"fiber status page v1"

_reporters: weakref.WeakSet[Any] = weakref.WeakSet()
_reporters_lock = threading.Lock()


def report(obj: Any) -> None:
    """Show ``obj`` (it has ``status_snapshot() -> dict``) in the live view while it lives."""
    with _reporters_lock:
        _reporters.add(obj)


def forget(obj: Any) -> None:
    """Stop showing ``obj`` (a pool that was joined)."""
    with _reporters_lock:
        _reporters.discard(obj)


def page_token(key: bytes) -> str:
    """The status page's token: an HMAC of a fixed label with the run's key.

    It opens the page and nothing else: the key cannot be recovered from it, and it
    does not authenticate to the hub.
    """
    return hmac.new(key, _PAGE_LABEL, "sha256").hexdigest()[:32]


def _process_row(p: Any) -> dict[str, Any]:
    """A process of the run that is no pool worker, as the live view shows it."""
    run = getattr(p, "_run", None)
    job = getattr(run, "job", None)
    backend = getattr(run, "backend", None)
    code = getattr(run, "exitcode", None)
    if code is not None:
        state = f"exited {code}"
    elif run is not None and job is not None and run.connected.is_set():
        state = "running"
    else:
        state = "starting"
    return {"name": p.name, "id": job.id if job is not None else None,
            "backend": backend.name if backend is not None else None,
            "host": job.host if job is not None else None, "state": state}


def snapshot(run: dict[str, Any], children: Iterable[Any]) -> dict[str, Any]:
    """The state of this process: ``run`` (who it is), its pools, its other processes."""
    with _reporters_lock:
        reporters = list(_reporters)
    pools = []
    for obj in reporters:
        try:
            pools.append(obj.status_snapshot())
        except Exception:  # a view must never break the program it looks at
            log.exception("fiber: the live view could not read %r", obj)
    pools.sort(key=lambda p: -p["age_seconds"])  # the oldest first
    workers = {w["id"] for pool in pools for w in pool["workers"] if w["id"] is not None}
    processes = []
    for p in list(children):
        job = getattr(getattr(p, "_run", None), "job", None)
        if job is None or job.id not in workers:  # (a pool's worker is shown with its pool)
            processes.append(_process_row(p))
    return {"run": {**run, "now": time.time()}, "pools": pools, "processes": processes}


class StatusServer:
    """What a program that shows its state serves: the hub route, the run file, the page."""

    def __init__(self, hub: Hub, key: bytes, rundir: str, run: dict[str, Any],
                 state: Callable[[], dict[str, Any]]) -> None:
        self._key = key
        self.run = run
        """Who the run is: id, pid, program, host, when it started."""
        self.state = state
        """The current snapshot (what :func:`snapshot` returns for this run)."""
        self._lock = threading.Lock()
        self._page: StatusPage | None = None
        self._closed = False
        self.path = os.path.join(rundir, RUN_FILE)
        """The run file (0600) that ``fiber top`` reads."""
        self._hub = hub
        hub.register(TARGET, self._on_connect)
        self._write_run_file()

    @property
    def url(self) -> str | None:
        """The status page's address with its token, once it is served (else ``None``)."""
        return None if self._page is None else self._page.url

    def serve_page(self, port: int = 0) -> str:
        """Serve the page on 127.0.0.1:``port`` (0: a free port); return its address with the token."""
        with self._lock:
            if self._page is None:
                # On first use: http.server costs an import that a run without a page skips.
                from fiber_core.runtime.status_page import StatusPage

                self._page = StatusPage(self.state, page_token(self._key), port)
                self._write_run_file()
            return self._page.url

    def _write_run_file(self) -> None:
        info = {**self.run, "addresses": self._hub.addresses, "key": self._key.hex(),
                "page": self.url}
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.write(fd, json.dumps(info).encode())
        finally:
            os.close(fd)
        os.replace(tmp, self.path)

    def _on_connect(self, target: str, sock: socket.socket) -> None:
        # A hub thread, after the handshake: the viewer holds the run's key.
        conn = Connection(sock)
        try:
            while not self._closed:
                ask = conn.recv_bytes(maxlength=64)
                if kind_of(ask) != STATUS_ASK:
                    raise unexpected(ask, "a status connection")
                conn.send_frame(STATUS_STATE, encode_status_state(self.state()))
        except (EOFError, OSError):
            pass
        except MessageError as e:
            log.warning("fiber: %s", e)
        finally:
            conn.close()

    def close(self) -> None:
        """Stop serving (at exit): the route, the page, the run file."""
        self._closed = True
        self._hub.unregister(TARGET)
        if self._page is not None:
            self._page.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


# -- the viewer's side: finding runs, asking them ---------------------------------------


class RunFile(NamedTuple):
    """A run that shows its state, as its run file says."""

    run_id: str
    pid: int
    program: str
    started: float
    addresses: str
    key: bytes
    page: str | None
    path: str


def _private(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid() and not st.st_mode & 0o077


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # another user's: not one of ours
    return True


def _read_run_file(directory: str) -> RunFile | None:
    """The run file in ``directory`` if it is this user's, private, and its process lives."""
    path = os.path.join(directory, RUN_FILE)
    try:
        dst = os.lstat(directory)
        if not stat.S_ISDIR(dst.st_mode) or not _private(dst):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not _private(st) or st.st_size > 1 << 16:
            return None
        data = json.loads(os.read(fd, 1 << 16))
        run = RunFile(run_id=str(data["id"]), pid=int(data["pid"]), program=str(data.get("program", "")),
                      started=float(data["started"]), addresses=str(data["addresses"]),
                      key=bytes.fromhex(data["key"]), page=data.get("page"), path=path)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    finally:
        os.close(fd)
    return run if _alive(run.pid) else None


def find_runs(tmpdir: str | None = None) -> list[RunFile]:
    """The live runs of this user that show their state, the newest first."""
    import tempfile  # the viewer's side only: a job's start does not load it

    base = tmpdir or tempfile.gettempdir()
    runs = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return []
    for entry in entries:
        if entry.name.startswith(RUN_DIR_PREFIX):
            run = _read_run_file(entry.path)
            if run is not None:
                runs.append(run)
    runs.sort(key=lambda r: -r.started)
    return runs


def find_run(run_id: str | None = None, tmpdir: str | None = None) -> RunFile:
    """The newest live run of this user that shows its state, or the one ``run_id`` names
    (or begins with). Raises :class:`FiberError` saying what to do when there is none."""
    import tempfile  # the viewer's side only

    runs = find_runs(tmpdir)
    where = tmpdir or tempfile.gettempdir()
    if run_id is None:
        if not runs:
            raise FiberError(
                f"no running program of yours shows its state (looked in {where}): start it "
                f"with FIBER_STATUS=1, fiber_core.init(status=True) or fiber_core.serve_status(), "
                f"with the same TMPDIR as here")
        return runs[0]
    found = [r for r in runs if r.run_id.startswith(run_id)]
    if len(found) == 1:
        return found[0]
    if not found:
        ids = ", ".join(r.run_id for r in runs) or "none"
        raise FiberError(f"no running program of yours with run id {run_id!r} shows its state "
                         f"(looked in {where}; those that do: {ids})")
    raise FiberError(f"run id {run_id!r} is the beginning of several: "
                     + ", ".join(r.run_id for r in found))


class Viewer:
    """A connection to a run that shows its state: :meth:`ask` returns its snapshot."""

    def __init__(self, run: RunFile, timeout: float = 10.0) -> None:
        self.run = run
        self._sock = dial(run.addresses, run.key, TARGET, timeout=timeout)
        self._conn = Connection(self._sock)
        self._timeout = timeout

    def ask(self) -> dict[str, Any]:
        """The run's state now. Raises ``EOFError``/``OSError`` once the program is gone."""
        self._sock.settimeout(self._timeout)
        self._conn.send_frame(STATUS_ASK)
        return decode_status_state(self._conn.recv_bytes())

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Viewer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def announce(text: str) -> None:
    """One line for the person who started the program, on its stderr (never a log file)."""
    try:
        print(f"fiber: {text}", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # no stderr
        pass


def bind_error(port: int, e: OSError) -> FiberError:
    """The error for a status page that cannot have its port."""
    if e.errno == errno.EADDRINUSE:
        return FiberError(f"the status page cannot use port {port} on 127.0.0.1: it is in use; "
                          f"choose another with status_port (0: any free port)")
    return FiberError(f"the status page cannot listen on 127.0.0.1:{port}: {e.strerror or e}")
