"""Spare jobs: workers started ahead, so that ``Process.start()`` lands on one already running.

Starting a job on another machine costs the platform's start (a container, an SSH
command) plus the worker's own (Python, ``import fiber_core``, the connection, the
main module): 60 to 130 ms, where a process already there starts its target in a
few. So, as Ray keeps idle workers and a warm function is kept by serverless
platforms, after a ``Process.start()`` this process starts ``spare_jobs`` more jobs
of the same kind in the background. Each runs the worker bootstrap up to the point
where it has connected, imported the main module and applied the settings (the
prelude), says so (``PROCESS_WAITING``), and waits there; only then is it ready. The
next ``start()`` of a process of that kind hands the process object to a spare instead
of asking the backend, and a new spare starts.

"Of the same kind" means the same backend and the same job spec apart from its
name (image, resources, command, ...), and the same prelude: a spare that was
sent other settings, another ``sys.path`` or another main module is not used (it
is let go, and a new one made). A spare that is not used within ``spare_timeout``
seconds is let go; one that ends on its own (a stopped container, a lost host) is
dropped. Letting one go is closing its connection: its worker exits with code 0.
A spare that cannot get ready (its image lacks the main module's imports, its job does
not start) is not tried again for that kind of job: the next cold start shows why.

``spare_jobs`` defaults to the backend's :attr:`~fiber_core.contract.backend.Backend.spare_jobs`
(1 on Docker and SSH, where an idle job costs little; 0 on Kubernetes and AWS Batch,
where it holds a node's room or costs money, and on the local backend, whose template
starts jobs as fast as a fork). A group start (a Pool's workers) takes the ready spares
of its kind as some of its workers, and starts no new spare: a Pool keeps its workers.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time

from fiber_core.base.errors import ConfigError
from fiber_core.base.log import log
from fiber_core.contract.env import ENV_TOKEN
from fiber_core.runtime.config import config
from fiber_core.runtime.run import runtime
from fiber_core.wire.framing import Connection
from fiber_core.wire.messages import PROCESS_PRELUDE, PROCESS_STDERR, PROCESS_WAITING, body, kind_of
from fiber_core.wire.serialize import dumps, loads

TYPE_CHECKING = False  # typing's own, without importing typing: a job starts without it
if TYPE_CHECKING:
    from collections.abc import Callable

    from fiber_core.contract.backend import Backend, Job, JobSpec


def wait_connected(backend: Backend, job: Job, connected: threading.Event, timeout: float | None,
                   give_up: threading.Event | None = None) -> tuple[int | None, bool]:
    """Wait until ``connected`` is set, ``job`` ends, ``timeout`` seconds pass or ``give_up`` is set.

    Returns ``(exit code, timed out)``: ``(None, False)`` once connected; the job's
    exit code if it ended first; ``(None, True)`` after ``timeout`` or when given up
    (the job is left running).
    """
    started = time.monotonic()
    delay = 0.002
    while not connected.wait(delay):
        code = backend.poll_job(job)
        if code is not None:
            return (None if connected.is_set() else code), False
        if timeout is not None and time.monotonic() - started > timeout:
            return None, True
        if give_up is not None and give_up.is_set():
            return None, True
        delay = min(delay * 1.5, 0.25)
    return None, False


def take_channel(job: Job, on_connect: Callable[[str, socket.socket], None]) -> None:
    """Give ``on_connect`` the connection to ``job`` that its backend made and handed down
    (:attr:`~fiber_core.contract.backend.Job.channel`), if it did: the job will not dial."""
    channel = job.take_channel()
    if channel is not None:
        on_connect("", channel)


def kind_of_job(backend: Backend, spec: JobSpec) -> tuple[int, str]:
    """What two jobs must share for one to stand in for the other: the backend and the
    spec without its name, labels and token."""
    import dataclasses  # in the parent, where the contract has loaded it

    env = {k: v for k, v in spec.env.items() if k != ENV_TOKEN}
    same = dataclasses.replace(spec, name="", labels={}, env=env)
    return id(backend), repr(dataclasses.astuple(same))


def wanted(backend: Backend) -> int:
    """How many spares to keep per kind of job on ``backend`` (``spare_jobs``)."""
    n = config.get("spare_jobs")
    if n is None:
        return type(backend).spare_jobs
    if n < 0:
        raise ConfigError(f"spare_jobs={n}: expected 0 (no spare jobs) or more")
    return int(n)


class Spare:
    """One spare job. Once :func:`claim` returned it, its job and socket are the claimer's.

    (A plain class: every job imports this module, and ``dataclasses`` would cost each ~5 ms.)
    """

    def __init__(self, kind: tuple[int, str], backend: Backend, prelude: bytes, token: str) -> None:
        self.kind = kind
        self.backend = backend
        self.prelude = prelude
        self.token = token
        self.job: Job | None = None
        self.sock: socket.socket | None = None
        self.connected = threading.Event()
        self.wake = threading.Event()
        """Set when it is claimed or let go: its thread stops waiting."""
        self.claimed = False
        self.created = threading.Event()
        """Set once the backend's call to start its job has returned (or failed)."""
        self.done = threading.Event()
        """Set when its thread has ended: it was claimed, or its job has ended."""


class _Spares:
    """This process's spares, ready or starting, by kind of job."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # a spare became ready or went
        self.ready: dict[tuple[int, str], list[Spare]] = {}
        self.starting: dict[tuple[int, str], list[Spare]] = {}
        self.failed: set[tuple[int, str]] = set()  # a spare of this kind could not start
        self.closing = False  # the runtime is shutting down
        self.owner: object = None  # the runtime whose shutdown lets them go


_spares = _Spares()


def _every() -> list[Spare]:
    """Every spare, ready or starting (under the lock)."""
    return [s for group in (*_spares.ready.values(), *_spares.starting.values()) for s in group]


def claim(backend: Backend, spec: JobSpec, prelude: bytes) -> Spare | None:
    """A ready spare for a job like ``spec`` that was sent ``prelude``, taken; else ``None``.

    Every ready spare that was sent another prelude is let go, whatever its kind: the
    program's settings changed (``init()`` may also have made a new backend).
    """
    kind = kind_of_job(backend, spec)
    stale = []
    found = None
    with _spares.lock:
        for group in _spares.ready.values():
            stale += [s for s in group if s.prelude != prelude]
            group[:] = [s for s in group if s.prelude == prelude]
        ready = _spares.ready.get(kind) or []
        while ready and found is None:
            spare = ready.pop(0)
            if _alive(spare):
                spare.claimed = True
                found = spare
            else:
                stale.append(spare)
    for spare in stale:
        _wake(spare)  # its thread lets go of it
    if found is not None:
        found.wake.set()  # its thread leaves it to the claimer
        assert found.job is not None
        found.job.spec.name = spec.name  # it runs that process now: what errors and logs name
    return found


def replenish(backend: Backend, spec: JobSpec, prelude: bytes) -> None:
    """Start spares in the background until ``spare_jobs`` of this kind are ready or starting."""
    n = wanted(backend)
    if n <= 0:
        return
    kind = kind_of_job(backend, spec)
    rt = runtime()
    with _spares.lock:
        if _spares.owner is not rt:  # the first, or a new runtime after the last one shut down
            _spares.owner, _spares.closing = rt, False
            _spares.failed.clear()
            rt.at_shutdown(release_all)
        if _spares.closing or kind in _spares.failed:
            return
        missing = n - len(_spares.ready.get(kind, ())) - len(_spares.starting.get(kind, ()))
        if missing <= 0:
            return
        new = []
        for _ in range(missing):
            spare = Spare(kind, backend, prelude, os.urandom(16).hex())
            _spares.starting.setdefault(kind, []).append(spare)
            thread = threading.Thread(target=_keep, args=(spare, spec), daemon=True, name="fiber-spare")
            new.append(thread)
    for thread in new:
        thread.start()


def settle(timeout: float | None = None) -> bool:
    """Wait until no spare is starting (each is ready, or gone); False after ``timeout``."""
    with _spares.changed:
        return _spares.changed.wait_for(lambda: not any(_spares.starting.values()), timeout)


def release(timeout: float | None = 60.0) -> None:
    """Let go of every spare now, ready or starting, and wait until their jobs have ended
    (new ones start after the next ``Process.start()``): to give their room back at once."""
    with _spares.lock:
        spares = _every()
    for spare in spares:
        _wake(spare)
    deadline = None if timeout is None else time.monotonic() + timeout
    for spare in spares:
        spare.done.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))


def any_ready(backend: Backend) -> bool:
    """Whether a spare of ``backend`` is ready (of any kind)."""
    with _spares.lock:
        return any(s.backend is backend for group in _spares.ready.values() for s in group)


def ready_jobs() -> list[Job]:
    """The jobs of the spares ready now, oldest first (the next to be used)."""
    with _spares.lock:
        return [s.job for group in _spares.ready.values() for s in group if s.job is not None]


def release_all() -> None:
    """At exit, before the backends' cleanup: no new spare, every one let go. Waits only
    for the backend calls under way, so that every spare job is tracked, and stopped by
    the cleanup if it has not ended by then."""
    with _spares.lock:
        _spares.closing = True
        spares = _every()
    for spare in spares:
        _wake(spare)
    for spare in spares:
        spare.created.wait(30.0)


def _alive(spare: Spare) -> bool:
    """The spare's job has not ended and its connection has not closed (it sends nothing
    until it runs a process: anything readable is its end)."""
    assert spare.job is not None and spare.sock is not None
    if spare.backend.poll_job(spare.job) is not None:
        return False
    try:
        return not select.select([spare.sock], [], [], 0)[0]
    except (OSError, ValueError):
        return False


def _keep(spare: Spare, spec: JobSpec) -> None:
    """A spare's thread: start its job, send it the prelude once it connects, wait until it
    is claimed, or let it go (timeout, exit) or drop it (it ended)."""
    import dataclasses  # in the parent, where the contract has loaded it

    backend = spare.backend
    hub = runtime().hub
    route = f"proc:{spare.token}"
    spec = dataclasses.replace(spec, name="spare", env={**spec.env, ENV_TOKEN: spare.token},
                               labels={**spec.labels, "fiber.name": "spare"})

    def on_connect(target: str, sock: socket.socket) -> None:
        if spare.connected.is_set():
            sock.close()
            return
        spare.sock = sock
        spare.connected.set()

    hub.register(route, on_connect)
    try:
        try:
            spare.job = backend.start_job(spec)
        except Exception as e:
            _give_up(spare, f"it could not start: {e}")
            return
        finally:
            spare.created.set()
        take_channel(spare.job, on_connect)
        timeout = config.get("start_timeout") or float(config.get("spare_timeout"))
        code, timed_out = wait_connected(backend, spare.job, spare.connected, timeout, spare.wake)
        if spare.wake.is_set():
            return
        if code is not None or timed_out:
            _give_up(spare, f"it ended with code {code} before it connected" if code is not None
                     else f"it did not connect within {timeout:g} s")
            return
        assert spare.sock is not None
        conn = Connection(spare.sock)
        # The prelude the claimer's is compared with, asking for PROCESS_WAITING once applied.
        conn.send_frame(PROCESS_PRELUDE, dumps({**loads(spare.prelude), "spare": True}))
        answered = select.select([spare.sock], [], [], timeout)[0]
        if spare.wake.is_set():
            return
        if not answered:
            _give_up(spare, f"it did not apply the program's settings within {timeout:g} s")
            return
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            _give_up(spare, "it ended before it was ready")
            return
        if kind_of(msg) != PROCESS_WAITING:  # applying the prelude failed: it sent why, and ends
            why = bytes(body(msg)).decode("utf-8", "replace") if kind_of(msg) == PROCESS_STDERR else repr(msg[:40])
            _give_up(spare, f"it did not get ready: {why}")
            return
        with _spares.changed:
            if _spares.closing or spare.wake.is_set():
                return
            _spares.starting[spare.kind].remove(spare)
            _spares.ready.setdefault(spare.kind, []).append(spare)
            _spares.changed.notify_all()
        spare.wake.wait(float(config.get("spare_timeout")))
    except Exception:
        log.exception("fiber: a spare job on %s failed", backend.name)
    finally:
        hub.unregister(route)
        with _spares.changed:
            if spare in _spares.starting.get(spare.kind, ()):
                _spares.starting[spare.kind].remove(spare)
            if spare in _spares.ready.get(spare.kind, ()):
                _spares.ready[spare.kind].remove(spare)
            claimed = spare.claimed
        try:
            if not claimed:
                _let_go(spare)
        finally:
            with _spares.changed:
                spare.done.set()
                _spares.changed.notify_all()


def _give_up(spare: Spare, why: str) -> None:
    """No more spares of this kind (a cold start of it shows the user what is wrong)."""
    log.debug("fiber: no spare jobs of this kind on %s: %s", spare.backend.name, why)
    with _spares.lock:
        _spares.failed.add(spare.kind)


def _wake(spare: Spare) -> None:
    """Have its thread let go of a spare that is not claimed: also when it waits for the
    spare's answer (the shut-down socket wakes it; the socket is closed by that thread only)."""
    spare.wake.set()
    sock = spare.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _let_go(spare: Spare) -> None:
    """Close a spare's connection (its worker exits 0), wait for its job's end, stop tracking
    it. At exit, only the connection: the backend's cleanup ends what still runs."""
    if spare.sock is not None:
        spare.sock.close()
    job, backend = spare.job, spare.backend
    if job is None or _spares.closing:
        return
    try:
        code = backend.wait_for_job(job, 10.0 if spare.sock is not None else 0.0)
        if code is None:
            backend.stop_job(job, force=True)
            code = backend.wait_for_job(job, 30.0)
        if code is not None:
            backend.untrack_job(job)
    except Exception as e:
        log.debug("fiber: a spare job on %s could not be stopped: %s", backend.name, e)
