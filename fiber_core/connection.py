"""``fiber_core.connection``: the names of :mod:`multiprocessing.connection`, over Fiber's transport.

``Pipe`` and ``wait`` are Fiber's. ``Listener``, ``Client`` and ``families`` are
the stdlib's (its sockets, framing and HMAC challenge), with its semantics: no
authentication unless an ``authkey`` is given. Every process of a Fiber program
holds the run's key as ``current_process().authkey``: pass it to both sides
(``Listener(authkey=fiber_core.current_process().authkey)``) so that only the
processes of the run can connect. The default address is a Unix socket,
reachable on this host only; for jobs on other hosts, listen on a TCP address
(``Listener(("0.0.0.0", 0))``) and give the job this host's name and the port.
"""

from __future__ import annotations

from multiprocessing import connection as _stdlib
from multiprocessing.connection import Client, Listener, answer_challenge, deliver_challenge

from fiber_core.processes.pipe import Pipe, PipeEnd
from fiber_core.wire.framing import Connection, wait

families: list[str] = _stdlib.families  # type: ignore[attr-defined]  # not in the stubs

__all__ = ["Client", "Connection", "Listener", "Pipe", "PipeEnd", "answer_challenge",
           "deliver_challenge", "families", "wait"]
