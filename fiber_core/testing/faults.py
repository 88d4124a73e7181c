"""Replayable fault schedules for chaos tests: a seed decides which faults strike, and when.

A schedule is pure: from a seed it lists the faults of a run, each at a point of the run's
own progress (after the k-th result), never at a time of the clock, so that the same seed
replays the same faults at the same points, and a failure seen once can be run again::

    seed = chaos_seed()                      # FIBER_CHAOS_SEED, else a random one (printed)
    schedule = FaultSchedule.spread(seed, results=10_000, count=60, kinds=("kill",))
    for fault in schedule.due(done):         # as results come in
        os.kill(pids[fault.worker % len(pids)], SIGNALS[fault.kind])

What a fault does and to whom (``worker`` is an index into the workers the test lists,
in a stable order) is the test's: this module does no I/O but for reading and printing
the seed.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Iterator, Sequence
from typing import NamedTuple

SEED_VARIABLE = "FIBER_CHAOS_SEED"
"""The environment variable that replays a chaos test's schedule."""

WORKER_CHOICES = 1 << 16
"""The range of a fault's ``worker`` index: the test takes it modulo its workers."""


class Fault(NamedTuple):
    """One fault: after ``after`` results, ``kind`` strikes worker index ``worker``."""

    after: int
    kind: str
    worker: int


class FaultSchedule:
    """The faults of a run, in the order they strike (by ``after``, then as drawn)."""

    def __init__(self, seed: int, faults: Sequence[Fault]) -> None:
        self.seed = seed
        self.faults = sorted(faults, key=lambda f: f.after)
        self._next = 0

    @classmethod
    def spread(cls, seed: int, results: int, count: int, kinds: Sequence[str] = ("kill",),
               first: int = 0, last: int | None = None) -> FaultSchedule:
        """``count`` faults of ``kinds`` at points drawn uniformly among results
        ``first`` to ``last`` (default: the last result but one, so each strikes a run still
        going), each on a drawn worker index. The same arguments give the same schedule."""
        if results < 1 or count < 0 or not kinds:
            raise ValueError("a schedule needs results >= 1, count >= 0 and at least one kind")
        last = results - 1 if last is None else min(last, results - 1)
        first = max(0, min(first, last))
        rng = random.Random(seed)
        faults = [Fault(rng.randint(first, last), rng.choice(list(kinds)), rng.randrange(WORKER_CHOICES))
                  for _ in range(count)]
        return cls(seed, faults)

    def due(self, done: int) -> Iterator[Fault]:
        """The faults not given yet whose point ``done`` results have reached, in order."""
        faults = self.faults
        while self._next < len(faults) and faults[self._next].after <= done:
            self._next += 1
            yield faults[self._next - 1]

    @property
    def left(self) -> int:
        """Faults not given yet."""
        return len(self.faults) - self._next

    def __repr__(self) -> str:
        return f"FaultSchedule(seed={self.seed}, {len(self.faults)} faults, {self.left} left)"


def chaos_seed(default: int | None = None) -> int:
    """The seed of a chaos test: :data:`SEED_VARIABLE` if set, else ``default``, else a random
    one; printed (``FIBER_CHAOS_SEED=...``) so that a failing run shows how to replay it."""
    text = os.environ.get(SEED_VARIABLE, "").strip()
    if text:
        try:
            seed = int(text)
        except ValueError:
            raise ValueError(f"{SEED_VARIABLE}={text!r} is not an integer: set it to the seed a "
                             f"failing run printed") from None
    elif default is not None:
        seed = default
    else:
        seed = random.SystemRandom().randrange(1 << 31)
    print(f"{SEED_VARIABLE}={seed}", file=sys.stderr, flush=True)
    return seed
