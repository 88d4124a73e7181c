"""``fiber_core.connection``: the names of :mod:`multiprocessing.connection`, over Fiber's transport.

``Pipe`` and ``wait`` are Fiber's. ``Listener`` and ``Client`` are the stdlib's
(its sockets, framing and HMAC challenge), authenticated by default with the
run's key, which every process of a Fiber program holds, where the stdlib does
no authentication without an ``authkey``: a Listener in one process accepts a
Client from any other process of the run and from nobody else. Their default
address is a Unix socket, reachable on this host only; for jobs on other hosts
listen on a TCP address (``Listener(("0.0.0.0", 0))``) and give the job
``listener.address`` with this host's name.
"""

from __future__ import annotations

from multiprocessing import connection as _stdlib
from multiprocessing.connection import answer_challenge, deliver_challenge, families
from typing import Any

from fiber_core.processes.pipe import Pipe, PipeEnd
from fiber_core.runtime.run import runtime
from fiber_core.wire.framing import Connection, wait

__all__ = ["Client", "Connection", "Listener", "Pipe", "PipeEnd", "answer_challenge",
           "deliver_challenge", "families", "wait"]


class Listener(_stdlib.Listener):
    """:class:`multiprocessing.connection.Listener`; ``authkey`` defaults to the run's key."""

    def __init__(self, address: Any = None, family: str | None = None, backlog: int = 1,
                 authkey: bytes | None = None) -> None:
        super().__init__(address, family, backlog, runtime().authkey if authkey is None else authkey)


def Client(address: Any, family: str | None = None,  # noqa: N802 - multiprocessing's name
           authkey: bytes | None = None) -> Any:
    """:func:`multiprocessing.connection.Client`; ``authkey`` defaults to the run's key."""
    return _stdlib.Client(address, family, runtime().authkey if authkey is None else authkey)
