"""Replayable fault schedules (``fiber_core.testing.faults``): pure, no processes."""

from __future__ import annotations

import pytest

from fiber_core.testing.faults import SEED_VARIABLE, Fault, FaultSchedule, chaos_seed


def test_the_same_seed_gives_the_same_faults_at_the_same_points() -> None:
    a = FaultSchedule.spread(1234, results=10_000, count=50, kinds=("kill", "term", "stop"))
    b = FaultSchedule.spread(1234, results=10_000, count=50, kinds=("kill", "term", "stop"))
    assert a.faults == b.faults
    assert a.faults != FaultSchedule.spread(1235, results=10_000, count=50,
                                            kinds=("kill", "term", "stop")).faults


def test_faults_come_in_the_order_of_their_points_within_the_run() -> None:
    s = FaultSchedule.spread(7, results=100, count=30, kinds=("kill", "term"), first=10)
    points = [f.after for f in s.faults]
    assert points == sorted(points)
    assert all(10 <= p <= 99 for p in points)
    assert {f.kind for f in s.faults} == {"kill", "term"}


def test_due_gives_each_fault_once_when_its_point_is_reached() -> None:
    s = FaultSchedule(0, [Fault(5, "kill", 1), Fault(2, "term", 0), Fault(5, "stop", 3)])
    assert list(s.due(1)) == []
    assert list(s.due(2)) == [Fault(2, "term", 0)]
    assert list(s.due(2)) == []  # given once
    assert list(s.due(9)) == [Fault(5, "kill", 1), Fault(5, "stop", 3)]  # both, as drawn
    assert s.left == 0


def test_a_schedule_without_results_or_kinds_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one kind"):
        FaultSchedule.spread(1, results=0, count=3)
    with pytest.raises(ValueError, match="at least one kind"):
        FaultSchedule.spread(1, results=10, count=3, kinds=())


def test_the_seed_comes_from_the_environment_and_is_printed(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(SEED_VARIABLE, "42")
    assert chaos_seed(default=7) == 42
    assert "FIBER_CHAOS_SEED=42" in capsys.readouterr().err
    monkeypatch.delenv(SEED_VARIABLE)
    assert chaos_seed(default=7) == 7
    seed = chaos_seed()
    assert f"FIBER_CHAOS_SEED={seed}" in capsys.readouterr().err
    monkeypatch.setenv(SEED_VARIABLE, "seven")
    with pytest.raises(ValueError, match="not an integer"):
        chaos_seed()
