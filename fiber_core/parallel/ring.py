"""``Ring``: a group of peer jobs that know their rank, for collective communication.

Each member runs ``func(rank, size)`` after ``initializer(*initargs)``. Before
either runs, the standard rendezvous variables are set in the member's
environment: ``MASTER_ADDR`` and ``MASTER_PORT`` (a free port on rank 0's host,
on the interface that reaches the parent), ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK``. So ``torch.distributed.init_process_group("gloo")`` (with the
default ``env://`` method) forms the group with no further setup, on any backend.

``run()`` waits for every member. If one fails, the others are stopped (a peer
blocked in a collective would otherwise wait forever) and :class:`RingError`
reports the rank and exit code.

The members start as one group start of the backend (all are created, or none).
With ``gang=True`` none runs its function until all run: on a platform that
starts what it has room for and keeps the rest waiting (pods Pending, Batch jobs
RUNNABLE), members that started would otherwise hold their GPUs, blocked in the
first collective, for peers that may never come. If the whole ring is not running
within ``gang_timeout`` seconds, every member is stopped and :class:`RingError`
says how many started. (A cluster with a gang scheduler, such as Kueue or the
coscheduling plugin, can also admit the pods together: give them its labels with
the Kubernetes backend's ``pod_template``.)
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from fiber_core.base.errors import FiberError
from fiber_core.contract.env import ENV_HUB
from fiber_core.parallel.queues import Queue
from fiber_core.parallel.synchronize import Barrier
from fiber_core.processes.process import Process, start_processes
from fiber_core.runtime.hub import reachable_host
from fiber_core.wire.framing import wait


class RingError(FiberError):
    """A member of a :class:`Ring` failed; ``rank`` and ``exitcode`` say which and how."""

    def __init__(self, message: str, rank: int, exitcode: int | None) -> None:
        super().__init__(message)
        self.rank, self.exitcode = rank, exitcode


def _member(rank: int, size: int, func: Callable, initializer: Callable | None, initargs: tuple,
            rendezvous: Queue, gang: Barrier | None = None) -> None:
    if gang is not None:
        try:
            gang.wait()  # until every member runs (the parent times it)
        except threading.BrokenBarrierError:
            raise SystemExit(f"ring member {rank}: the ring did not start whole") from None

    if rank == 0:
        host = reachable_host(os.environ[ENV_HUB])
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        for _ in range(size - 1):
            rendezvous.put((host, port))
    else:
        host, port = rendezvous.get()
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(size), LOCAL_RANK="0")
    if initializer is not None:
        initializer(*initargs)
    func(rank, size)


class Ring:
    """``processes`` peer jobs running ``func(rank, size)``.

    Resources (``cpu``, ``memory``, ``gpu``, ``gpu_type``) and ``backend`` apply to
    every member, and default to what :func:`fiber_core.meta` put on ``func``.
    ``gang=True``: no member runs ``func`` before all run (see the module's text);
    :meth:`start` then returns once they all do.
    """

    def __init__(self, processes: int, func: Callable, initializer: Callable | None = None,
                 initargs: tuple = (), *, backend: str | None = None, gang: bool = False,
                 gang_timeout: float = 300.0, **resources: Any) -> None:
        if not isinstance(processes, int) or processes < 1:
            raise ValueError("a Ring needs at least 1 process")
        if isinstance(gang_timeout, bool) or not isinstance(gang_timeout, (int, float)) or not gang_timeout > 0:
            raise ValueError(f"gang_timeout must be a number of seconds above 0, not {gang_timeout!r}")
        self._gang = bool(gang)
        self._gang_timeout = float(gang_timeout)
        if not callable(func):
            raise TypeError("func must be callable")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be callable")
        self.size = processes
        self._func = func
        self._initializer = initializer
        self._initargs = tuple(initargs)
        meta = getattr(func, "__fiber_meta__", None) or {}
        self._resources = {k: v for k, v in {**meta, **resources}.items() if v is not None}
        self._backend = backend
        self.members: list[Process] = []

    def start(self) -> None:
        if self.members:
            raise AssertionError("a Ring can be started once")
        rendezvous = Queue()
        gang = Barrier(self.size + 1) if self._gang else None  # the members and this process
        members = [Process(target=_member, name=f"Ring-{rank}", backend=self._backend,
                           args=(rank, self.size, self._func, self._initializer, self._initargs,
                                 rendezvous, gang), **self._resources)
                   for rank in range(self.size)]
        start_processes(members)
        self.members = members
        if gang is not None:
            self._wait_gang(gang)

    def _wait_gang(self, gang: Barrier) -> None:
        """Release the members once all run; stop them all if they do not within the
        timeout, or at once if one ends first."""
        started = threading.Event()

        def watch() -> None:  # a member that ends before the gang starts breaks it now
            if wait([p.sentinel for p in self.members], self._gang_timeout) and not started.is_set():
                gang.abort()

        threading.Thread(target=watch, daemon=True, name="fiber-ring-gang").start()
        try:
            gang.wait(self._gang_timeout)
            started.set()
            return
        except threading.BrokenBarrierError:
            started.set()
        running = sum(1 for p in self.members if p.connected())
        ended = [(rank, p) for rank, p in enumerate(self.members) if p.exitcode is not None]
        self.terminate()
        if ended:
            rank, p = ended[0]
            raise RingError(f"ring member {rank} ({p.name}) exited with code {p.exitcode} "
                            "before the ring started", rank, p.exitcode)
        raise RingError(f"only {running} of {self.size} ring members were running after "
                        f"gang_timeout={self._gang_timeout:g} s: the platform did not give the ring "
                        "all its members; it was stopped whole (none ran its function)", -1, None)

    def join(self, timeout: float | None = None) -> None:
        """Wait for every member; on the first failure stop the rest and raise RingError."""

        pending = {p.sentinel: (rank, p) for rank, p in enumerate(self.members)}
        while pending:
            ready = wait(list(pending), timeout)
            if not ready:
                return
            for fd in ready:
                rank, p = pending.pop(fd)
                p.join()
                if p.exitcode != 0:
                    self.terminate()
                    raise RingError(f"ring member {rank} ({p.name}) exited with code {p.exitcode}",
                                    rank, p.exitcode)

    def terminate(self) -> None:
        for p in self.members:
            p.terminate()
        for p in self.members:
            p.join()

    def run(self) -> None:
        """Start the members and wait for all of them."""
        self.start()
        self.join()
