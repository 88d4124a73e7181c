"""A task's stable identity and seed, as :func:`fiber_core.current_task` tells it inside a task.

A task is one item of a Pool or executor call. Its identity is the call's ordinal (its
place in the program's sequence of Pool and executor calls), the item's position in the
call's input, and the attempt (0, then 1 more each time its unit went back to the queue:
a lost worker, a retry after it raised, a drain). Its seed is derived from the run's seed,
the call and the item, never the attempt: the same on a retry, on a backup copy and, with
a journal (which keeps the run's seed), after the master restarted. The worker sets the
identity around each item it runs (:func:`enter`, :func:`at`); this module is all a
worker loads for it.
"""

from __future__ import annotations

import collections
import struct

from fiber_core.base.blake2 import blake2b

_SEED = struct.Struct("!QQQ")

TYPE_CHECKING = False  # typing's own, without importing typing: a pool worker starts without it
if TYPE_CHECKING:
    from typing import NamedTuple

    class Task(NamedTuple):  # the record as type checkers see it; at run time, the one below
        call: int
        item: int
        attempt: int
        seed: int
else:
    # The same record, made without typing.NamedTuple: that imports typing and compiles each
    # field's annotation when the class is made, 3 ms of a new interpreter's pool worker.
    # tests/test_journal.py checks that both name the same fields.
    Task = collections.namedtuple("Task", ("call", "item", "attempt", "seed"), module=__name__)
    Task.__doc__ = """The task that runs now: ``call`` (its call's ordinal), ``item`` (its position
    in the call's input), ``attempt`` (0 the first time), ``seed`` (a 64-bit seed of the run, the
    call and the item). A named tuple."""


def seed_of(run_seed: int, call: int, item: int) -> int:
    """The seed of item ``item`` of call ``call`` in a run seeded with ``run_seed``: 64 bits of
    BLAKE2b, so that neighbouring items get unrelated seeds."""
    key = _SEED.pack(run_seed & 0xFFFF_FFFF_FFFF_FFFF, call, item)
    return int.from_bytes(blake2b(key, digest_size=8, person=b"fiber-task").digest(), "big")


class _Now:
    __slots__ = ("call", "start", "attempt", "run_seed", "offset")

    def __init__(self) -> None:
        self.call = -1  # no task runs
        self.start = self.attempt = self.run_seed = self.offset = 0


_now = _Now()


def enter(call: int, start: int, attempt: int, run_seed: int) -> None:
    """A unit of call ``call`` whose first item is at ``start`` begins (in the worker)."""
    now = _now
    now.call, now.start, now.attempt, now.run_seed, now.offset = call, start, attempt, run_seed, 0


def at(offset: int) -> None:
    """The unit's item ``offset`` begins."""
    _now.offset = offset


def leave() -> None:
    _now.call = -1


def current_task() -> Task | None:
    """The task this process runs now (in a Pool's worker, inside a task), else None.

    Use ``seed`` for the task's random numbers and ``(call, item)`` as the key of a side
    effect that must happen once (a write keyed by it is the same write when the task
    runs again); see docs/durable.md.
    """
    now = _now
    if now.call < 0:
        return None
    item = now.start + now.offset
    return Task(now.call, item, now.attempt, seed_of(now.run_seed, now.call, item))
