"""The Pool's loss ledger (``fiber_core.parallel.pool.ledger``): pure rules, no workers."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from fiber_core.contract.jobs import EndReason
from fiber_core.parallel.pool.ledger import (
    MAX_START_FAILURES,
    MAX_START_KILLS,
    MAX_TASK_ATTEMPTS,
    MAX_TASK_FREEZES,
    MAX_TASK_KILLS,
    Fault,
    LossWindow,
    Start,
    StartStreak,
    budget,
    charge,
    describe_end,
    fault_of,
    lost_message,
    running_item,
)

KILL, TERM = -int(signal.SIGKILL), -int(signal.SIGTERM)


def unit(watch: bool) -> SimpleNamespace:
    return SimpleNamespace(watch=watch)


# -- what a death may cost ---------------------------------------------------------------


@pytest.mark.parametrize("code,reason,draining,fault", [
    (1, EndReason.EXITED, False, Fault.TASK),  # its own exit
    (-11, EndReason.EXITED, False, Fault.TASK),  # a crash
    (KILL, EndReason.EXITED, False, Fault.TASK),  # a SIGKILL that may be an OOM kill
    (KILL, None, False, Fault.TASK),  # its end not known
    (KILL, EndReason.KILLED, False, Fault.KILLED),  # known not to be an OOM kill
    (KILL, EndReason.OOM, False, Fault.OOM),
    (TERM, EndReason.EXITED, False, Fault.NONE),  # the polite stop of a preemption
    (KILL, EndReason.PREEMPTED, False, Fault.NONE),
    (KILL, EndReason.HOST_LOST, False, Fault.NONE),
    (KILL, EndReason.STOPPED, False, Fault.NONE),
    (KILL, EndReason.KILLED, True, Fault.NONE),  # it had said it was draining
    (KILL, EndReason.OOM, True, Fault.NONE),
    (KILL, EndReason.UNRESPONSIVE, False, Fault.FROZE),  # no heartbeat: the master stopped it
    (KILL, EndReason.UNRESPONSIVE, True, Fault.NONE),  # frozen while it drained
])
def test_the_end_of_a_worker_says_what_it_may_cost(code: int, reason: EndReason | None,
                                                    draining: bool, fault: Fault) -> None:
    assert fault_of(code, reason, draining) is fault


def test_budgets_fail_an_oom_at_once_and_outside_kills_last() -> None:
    assert budget(Fault.OOM, 3) == 1
    assert budget(Fault.TASK, 3) == 3 == MAX_TASK_ATTEMPTS
    assert budget(Fault.TASK, 7) == 7
    assert budget(Fault.KILLED, 3) == MAX_TASK_KILLS > MAX_TASK_ATTEMPTS
    assert budget(Fault.FROZE, 7) == MAX_TASK_FREEZES


def test_one_freeze_is_not_the_items_fault_and_a_task_that_freezes_every_time_fails() -> None:
    charges: dict = {}
    assert charge(charges, 4, Fault.FROZE, 3) == (1, False)  # stopped from outside: it runs again
    for n in range(2, MAX_TASK_FREEZES):
        assert charge(charges, 4, Fault.FROZE, 3) == (n, False)
    assert charge(charges, 4, Fault.TASK, 3) == (1, False)  # the other budgets are untouched
    assert charge(charges, 4, Fault.FROZE, 3) == (MAX_TASK_FREEZES, True)


# -- which item was running ---------------------------------------------------------------


def test_only_an_item_the_worker_said_it_started_is_the_culprit() -> None:
    watched = [unit(watch=True)]
    assert running_item(7, watched, (7, 4)) == 4
    assert running_item(7, watched, (7, 0)) == 0


def test_a_watched_batch_held_unstarted_has_no_culprit() -> None:
    watched = [unit(watch=True)]
    assert running_item(7, watched, None) is None  # it never said it started it
    assert running_item(7, watched, (6, 3)) is None  # what it said is of an earlier batch


def test_a_batch_that_is_not_watched_has_no_culprit() -> None:
    assert running_item(7, [unit(watch=False)], (7, 0)) is None
    assert running_item(7, [unit(watch=False)], None) is None
    assert running_item(7, [unit(watch=True), unit(watch=True)], (7, 0)) is None
    assert running_item(7, [], None) is None


# -- charges are per item ---------------------------------------------------------------


def test_deaths_while_different_items_of_one_unit_ran_fail_none_of_them() -> None:
    charges: dict = {}
    for item in (3, 11, 17):  # a unit of 20 items, three deaths, three different items
        count, fails = charge(charges, item, Fault.TASK, 3)
        assert (count, fails) == (1, False)


def test_an_item_fails_when_it_spends_its_budget() -> None:
    charges: dict = {}
    assert charge(charges, 5, Fault.TASK, 3) == (1, False)
    assert charge(charges, 5, Fault.TASK, 3) == (2, False)
    assert charge(charges, 5, Fault.TASK, 3) == (3, True)
    assert charge({}, 5, Fault.OOM, 3) == (1, True)


def test_outside_kills_draw_on_their_own_budget() -> None:
    charges: dict = {}
    for n in range(1, MAX_TASK_KILLS):
        assert charge(charges, 0, Fault.KILLED, 3) == (n, False)
    assert charge(charges, 0, Fault.TASK, 3) == (1, False)  # the other budget is untouched
    assert charge(charges, 0, Fault.KILLED, 3) == (MAX_TASK_KILLS, True)


def test_the_lost_message_names_the_item_and_why() -> None:
    text = lost_message("item 17 of map(f)", 3, Fault.TASK, "PoolWorker-3 exited with code 1")
    assert text == ("task lost: item 17 of map(f): its worker died 3 times while running it; "
                    "the last, PoolWorker-3 exited with code 1. It is not run again")
    assert "died once" in lost_message("item 1 of map(f)", 1, Fault.OOM, "x")
    killed = lost_message("item 2 of map(f)", 10, Fault.KILLED, "x")
    assert "killed by SIGKILL 10 times" in killed and "own process" in killed
    froze = lost_message("item 3 of map(f)", 3, Fault.FROZE, "x")
    assert "stopped answering 3 times" in froze and "heartbeat_timeout" in froze


def test_an_end_is_described_for_people() -> None:
    assert describe_end("W", KILL, EndReason.OOM, "", 512) == "W was killed by the system: out of memory, limit 512 MiB"
    assert describe_end("W", KILL, EndReason.KILLED) == \
        "W was killed by SIGKILL (not sent by Fiber, not an out-of-memory kill)"
    assert "an out-of-memory kill looks the same" in describe_end("W", KILL, EndReason.EXITED)
    assert describe_end("W", TERM, None) == "W was killed by SIGTERM"
    assert describe_end("W", -99, None) == "W was killed by signal 99"
    assert describe_end("W", 3, EndReason.EXITED, "log said x") == "W exited with code 3 (log said x)"
    assert describe_end("W", None, None) == "W was lost"
    assert describe_end("W", KILL, EndReason.PREEMPTED, "spot") == "W was preempted or evicted (spot)"
    assert describe_end("W", KILL, EndReason.UNRESPONSIVE, "no heartbeat for 15.2 s") == \
        "W stopped answering and was stopped (no heartbeat for 15.2 s)"


# -- the pool-wide bounds -----------------------------------------------------------------


def test_losses_past_the_limit_within_the_window_are_too_many() -> None:
    window = LossWindow(limit=2, window=10.0)
    assert not window.add(0.0) and not window.add(1.0)
    assert window.add(2.0) and len(window) == 3
    assert not window.add(11.5)  # those at 0 and 1 s left the window
    assert len(window) == 2


def test_a_start_streak_of_exits_fails_the_pool() -> None:
    streak = StartStreak()
    for _ in range(MAX_START_FAILURES - 1):
        assert streak.died(1, EndReason.EXITED, connected=True) is Start.AGAIN
    assert streak.died(1, EndReason.EXITED, connected=False) is Start.BROKEN
    assert streak.length == MAX_START_FAILURES


def test_a_worker_that_becomes_ready_ends_the_streak() -> None:
    streak = StartStreak()
    for _ in range(MAX_START_FAILURES - 1):
        streak.died(1, EndReason.EXITED, connected=True)
    streak.ready()
    assert streak.died(1, EndReason.EXITED, connected=True) is Start.AGAIN


def test_outside_kills_before_connecting_are_losses_not_a_streak() -> None:
    streak = StartStreak()
    for _ in range(5 * MAX_START_KILLS):
        assert streak.died(KILL, EndReason.KILLED, connected=False) is Start.OUTSIDE
    assert streak.length == 0
    for _ in range(MAX_START_KILLS - 1):
        assert streak.died(KILL, EndReason.EXITED, connected=True) is Start.AGAIN
    assert streak.died(KILL, EndReason.EXITED, connected=True) is Start.BROKEN
    assert StartStreak().died(KILL, EndReason.OOM, connected=False) is Start.AGAIN  # for its memory
