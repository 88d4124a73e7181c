"""The Pool's loss ledger: what the loss of a worker costs, and whom.

Pure: the master gives it the facts (an exit code, an end reason, what the worker
held and which item it said it started, the time) and applies what it decides. No
sockets, no threads, no clock of its own.

The rules
---------
* **Only an item that was running is charged**, and only one the worker *said* it
  started: a *watched* batch (one unit, sent alone) announces each item with
  ``POOL_RUNNING`` before it runs it (the first as soon as the worker begins the batch,
  before it loads the function and the arguments). A batch that is not watched says nothing, so
  no item of it is known to have started: a death there charges nothing, and each
  of its units runs again alone and watched. A worker that was starting, idle,
  draining, or holding work it had not begun is charged to nobody. So a task that
  kills its worker every time runs once unwatched, then watched until its budget
  is spent.
* **Charges are per item**, not per unit: a unit of twenty items killed three
  times while three different items ran has charged each item once.
* **What a death may cost** (:func:`fault_of`): nothing when the job's end says the
  platform took it (preempted, host lost, stopped by Fiber) or it was told to stop
  (SIGTERM, a drain); the item fails at once for an out-of-memory kill; a SIGKILL
  that the platform says was *not* an OOM kill (``EndReason.KILLED``) comes from
  outside as a rule, so it draws on a budget of its own, :data:`MAX_TASK_KILLS`,
  which only a task that kills its own process spends; anything else (its exit, a
  crash, a SIGKILL that may be an OOM kill) draws on ``task_losses``
  (:data:`MAX_TASK_ATTEMPTS` by default).
* **A frozen worker** (``EndReason.UNRESPONSIVE``: no heartbeat within
  ``heartbeat_timeout``, stopped by the master) is not its item's fault once: the
  process was stopped from outside, a network file system hung, a driver stuck. A task
  that freezes its worker again and again (a C extension that holds the GIL past the
  bound, a deadlock of its own) is: it draws on :data:`MAX_TASK_FREEZES`, so that it
  fails, named, instead of costing a bound's wait forever.
* **Losses that are nobody's fault are bounded pool-wide** (:class:`LossWindow`):
  ``loss_limit`` of them within a window, then the pool fails, saying the platform
  keeps taking workers.
* **Workers that die before they are ready** (:class:`StartStreak`): a broken image
  or initializer fails the pool after :data:`MAX_START_FAILURES` in a row, or
  :data:`MAX_START_KILLS` in a row ended by a signal after they connected; one
  killed from outside before it connected is a loss, not a streak.
"""

from __future__ import annotations

import collections
import enum
import signal
from collections.abc import Sequence
from typing import Any

from fiber_core.contract.jobs import EndReason

MAX_TASK_ATTEMPTS = 3
"""Deaths that may be its fault (its exit, a crash, a SIGKILL that may be an OOM kill)
while an item runs, before it fails (``task_losses``): enough that a worker lost by
bad luck twice does not fail a map, few enough that a task that crashes its worker
is found quickly."""

MAX_TASK_KILLS = 10
"""SIGKILLs known not to be OOM kills while an item runs, before it fails. They come
from outside as a rule: at one kill of a random worker every 0.1 s, a given 10 ms item
is hit with a chance of about 1 in 80 per run, so ten in a row never happen by
chance; a task that kills its own process reaches the bound."""

MAX_TASK_FREEZES = 3
"""Times a worker may be found frozen (``EndReason.UNRESPONSIVE``) while an item runs, before
the item fails. A freeze from outside hits a given item twice only by rare bad luck; each
one costs the run a whole ``heartbeat_timeout``, so a task that freezes its worker every
time is stopped after three."""

MAX_START_FAILURES = 3
"""Workers in a row that exit (or crash) before they are ready: a broken image or initializer."""

MAX_START_KILLS = 10
"""Workers in a row ended by a signal after they connected and before they were ready."""

LOSS_LIMIT = 100
"""The least number of losses that are nobody's fault a pool allows within :data:`LOSS_WINDOW`
(``10 * processes`` for bigger pools)."""

LOSS_WINDOW = 600.0
"""Seconds over which :data:`LOSS_LIMIT` counts."""

OUTSIDE_KILLS = frozenset(int(s) for s in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP))
"""Signals that come from outside (an operator, a reclaimed node), never from a broken image."""


class Fault(enum.Enum):
    """What a worker's death may cost the item it ran."""

    NONE = "none"
    """The platform took the worker, or it was told to stop: nobody's fault."""
    OOM = "oom"
    """An out-of-memory kill: the item fails at once."""
    KILLED = "killed"
    """A SIGKILL known not to be an OOM kill: :data:`MAX_TASK_KILLS`."""
    TASK = "task"
    """May be the item's fault: ``task_losses``."""
    FROZE = "froze"
    """The worker stopped answering while the item ran: :data:`MAX_TASK_FREEZES`."""


def fault_of(code: int | None, reason: EndReason | None, draining: bool) -> Fault:
    """What a death with exit ``code`` and end ``reason`` may cost the item that ran.

    ``draining``: the worker had said it was told to stop (SIGTERM) and would finish
    only its current batch.
    """
    if draining or (reason is not None and reason.infrastructure):
        return Fault.NONE
    if reason is EndReason.OOM:
        return Fault.OOM
    if reason is EndReason.UNRESPONSIVE:
        return Fault.FROZE
    if code == -signal.SIGTERM:  # the polite stop of a preemption
        return Fault.NONE
    if reason is EndReason.KILLED:
        return Fault.KILLED
    return Fault.TASK


def budget(fault: Fault, task_losses: int) -> int:
    """Deaths of kind ``fault`` an item may cause before it fails."""
    if fault is Fault.OOM:
        return 1
    if fault is Fault.KILLED:
        return MAX_TASK_KILLS
    if fault is Fault.FROZE:
        return MAX_TASK_FREEZES
    return task_losses


def running_item(batch_id: int, units: Sequence[Any], running: tuple[int, int] | None) -> int | None:
    """The item a lost worker was running in its oldest batch ``batch_id``, or None.

    Known only for a watched batch (a single unit whose ``watch`` is set) whose start
    of an item the worker announced (``running`` is the last ``(batch, item)`` it sent):
    of any other batch, no item is known to have started.
    """
    if running is None or running[0] != batch_id or len(units) != 1 or not units[0].watch:
        return None
    return running[1]


def charge(charges: dict[tuple[int, Fault], int], item: int, fault: Fault,
           task_losses: int) -> tuple[int, bool]:
    """Charge one death of kind ``fault`` to ``item`` (its unit's ``charges``).

    Returns the deaths of that kind charged to it so far and whether it has spent
    its budget (:func:`budget`) and fails. ``fault`` is never :attr:`Fault.NONE`.
    """
    key = (item, fault)
    count = charges[key] = charges.get(key, 0) + 1
    return count, count >= budget(fault, task_losses)


def lost_message(task: str, count: int, fault: Fault, what: str) -> str:
    """The text of the ``TaskLostError`` of an item that spent its budget."""
    times = "once" if count == 1 else f"{count} times"
    if fault is Fault.KILLED:
        return (f"task lost: {task}: its worker was killed by SIGKILL {times} while running it, "
                f"never by the out-of-memory killer (does the task kill its own process?); "
                f"the last, {what}. It is not run again")
    if fault is Fault.FROZE:
        return (f"task lost: {task}: its worker stopped answering {times} while running it "
                f"(does the task hold the GIL in a C call, or wait on itself?); the last, {what}. "
                f"It is not run again; a task may hold the GIL for less than heartbeat_timeout")
    return f"task lost: {task}: its worker died {times} while running it; the last, {what}. It is not run again"


_ENDS = {EndReason.STOPPED: "was stopped",
         EndReason.PREEMPTED: "was preempted or evicted",
         EndReason.HOST_LOST: "lost its host",
         EndReason.NEVER_STARTED: "could not be started",
         EndReason.UNRESPONSIVE: "stopped answering and was stopped",
         EndReason.KILLED: "was killed by SIGKILL (not sent by Fiber, not an out-of-memory kill)"}


def describe_end(name: str, code: int | None, reason: EndReason | None, detail: str = "",
                 memory: Any = None) -> str:
    """What happened to worker ``name``, for people: "PoolWorker-3 was killed by the system:
    out of memory, limit 512 MiB". ``memory``: its job's memory limit (MiB), if any."""
    if reason is EndReason.OOM:
        text = f"{name} was killed by the system: out of memory"
        if memory:
            text += f", limit {memory} MiB"
    elif reason is not None and reason is not EndReason.EXITED:
        text = f"{name} {_ENDS[reason]}"
    elif code is not None and code < 0:
        try:
            signame = signal.Signals(-code).name
        except ValueError:
            signame = f"signal {-code}"
        text = f"{name} was killed by {signame}"
        if code == -signal.SIGKILL:
            text += " (not sent by Fiber; an out-of-memory kill looks the same where the platform does not say)"
    elif code is not None:
        text = f"{name} exited with code {code}"
    else:
        text = f"{name} was lost"
    return f"{text} ({detail})" if detail else text


class LossWindow:
    """Losses that are nobody's fault, within the last ``window`` seconds: at most ``limit``."""

    def __init__(self, limit: int, window: float) -> None:
        self.limit, self.window = limit, window
        self._times: collections.deque[float] = collections.deque()

    def add(self, now: float) -> bool:
        """Count a loss at time ``now``; True when the losses in the window exceed the limit."""
        self._times.append(now)
        while self._times and self._times[0] < now - self.window:
            self._times.popleft()
        return len(self._times) > self.limit

    def __len__(self) -> int:
        return len(self._times)


class Start(enum.Enum):
    """What the death of a worker that was not ready yet means."""

    OUTSIDE = "outside"
    """Killed from outside before it connected: a loss for :class:`LossWindow`, not a streak."""
    AGAIN = "again"
    """Part of a streak still short of its limit: start another."""
    BROKEN = "broken"
    """The streak reached its limit: the image or initializer is broken; the pool fails."""


class StartStreak:
    """Workers in a row that died before they were ready (any that becomes ready ends the streak)."""

    def __init__(self) -> None:
        self.failures = 0  # exited or crashed by itself
        self.kills = 0  # ended by a signal after it connected

    def ready(self) -> None:
        """A worker became ready: the image and initializer work."""
        self.failures = self.kills = 0

    def died(self, code: int | None, reason: EndReason | None, connected: bool) -> Start:
        """A worker died before it was ready (and not for the platform's reasons)."""
        signum = -code if code is not None and code < 0 else 0
        killed = signum > 0 and reason is not EndReason.OOM
        if killed and not connected and signum in OUTSIDE_KILLS:
            return Start.OUTSIDE  # a broken image exits or crashes by itself
        if killed:
            self.kills += 1
        else:
            self.failures += 1
        if self.failures >= MAX_START_FAILURES or self.kills >= MAX_START_KILLS:
            return Start.BROKEN
        return Start.AGAIN

    @property
    def length(self) -> int:
        """The longer streak, for the error that fails the pool."""
        return max(self.failures, self.kills)
