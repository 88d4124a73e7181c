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
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

from fiber_core.base.errors import FiberError
from fiber_core.contract.env import ENV_HUB
from fiber_core.parallel.queues import Queue
from fiber_core.processes.process import Process
from fiber_core.runtime.hub import reachable_host
from fiber_core.wire.framing import wait


class RingError(FiberError):
    """A member of a :class:`Ring` failed; ``rank`` and ``exitcode`` say which and how."""

    def __init__(self, message: str, rank: int, exitcode: int | None) -> None:
        super().__init__(message)
        self.rank, self.exitcode = rank, exitcode


def _member(rank: int, size: int, func: Callable, initializer: Callable | None, initargs: tuple,
            rendezvous: Queue) -> None:

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
    """

    def __init__(self, processes: int, func: Callable, initializer: Callable | None = None,
                 initargs: tuple = (), *, backend: str | None = None, **resources: Any) -> None:
        if not isinstance(processes, int) or processes < 1:
            raise ValueError("a Ring needs at least 1 process")
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
        for rank in range(self.size):
            p = Process(target=_member, name=f"Ring-{rank}", backend=self._backend,
                        args=(rank, self.size, self._func, self._initializer, self._initargs,
                              rendezvous), **self._resources)
            p.start()
            self.members.append(p)

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
