"""The Pool's batch planner (``fiber_core.parallel.pool.planner``): pure sizes, no workers."""

from __future__ import annotations

from fiber_core.parallel.pool.planner import (
    AUTO_UNITS_MAX,
    AUTO_UNITS_PER_WORKER,
    MAP_BATCH_SECONDS,
    MAX_BATCH_UNITS,
    TARGET_BATCH_SECONDS,
    auto_units,
    batch_size,
    estimate,
    fair_sharers,
    prefetch_wanted,
    runs_long,
    starts_now,
    unit_bounds,
    updated,
)


def test_a_map_is_cut_into_64_units_per_worker_at_most_4096() -> None:
    assert auto_units(8, 10_000, None) == 8 * AUTO_UNITS_PER_WORKER
    assert auto_units(200, 10**6, None) == max(4 * 200, AUTO_UNITS_MAX)
    assert auto_units(2000, 10**6, None) == 4 * 2000  # at least 4 per worker
    assert auto_units(8, 30, None) == 30  # one item each for short inputs
    assert auto_units(8, 0, None) == 0


def test_tiny_known_tasks_make_fewer_units_but_4_per_worker() -> None:
    # 10,000 items of 1 us: 10 ms in all, 10 units of MIN_UNIT_SECONDS; never under 4 per worker
    assert auto_units(8, 10_000, 1e-6) == 32
    assert auto_units(8, 10_000, 1e-3) == 512  # long tasks: as many as without a hint


def test_units_differ_by_one_item_at_most() -> None:
    bounds = unit_bounds(10, 4)
    assert bounds == [0, 3, 6, 8, 10]
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert max(sizes) - min(sizes) <= 1
    assert unit_bounds(0, 0) == [0]


def test_a_call_s_own_time_wins_over_an_earlier_call_s_hint() -> None:
    assert estimate(0.5, 0.001, 10) == (0.5, True)
    assert estimate(None, 0.001, 10) == (0.01, False)
    assert estimate(None, None, 10) == (None, False)
    assert updated(None, 2.0) == 2.0
    assert updated(1.0, 2.0) == 0.8 * 1.0 + 0.2 * 2.0


def test_a_batch_holds_its_target_time_within_its_share() -> None:
    sharers = fair_sharers(8, 8)
    assert sharers == 16
    # 1 ms units, lots queued: 20 ms of an imap, 250 ms of a map
    assert batch_size(0.001, True, 100_000, sharers, False) == int(TARGET_BATCH_SECONDS / 0.001)
    assert batch_size(0.001, True, 100_000, sharers, True) == int(MAP_BATCH_SECONDS / 0.001)
    # tiny units: capped
    assert batch_size(1e-7, True, 10**7, sharers, True) == MAX_BATCH_UNITS
    # little queued: half a fair share (two batches in flight make one share) ...
    assert batch_size(0.001, False, 64, sharers, True) == 64 // 16
    # ... unless that is under MIN_SPLIT_SECONDS of measured work: up to a full share
    assert batch_size(1e-6, True, 64, sharers, True) == 2 * 64 // 16
    assert batch_size(10.0, True, 1, sharers, False) == 1  # always at least one


def test_starting_workers_count_in_a_fair_share() -> None:
    assert fair_sharers(2, 8) == 16
    assert fair_sharers(12, 8) == 24


def test_a_prefetch_goes_only_where_it_will_not_wait_long() -> None:
    assert prefetch_wanted(0.001, 10, 100, 16, is_map=True)
    assert not prefetch_wanted(0.001, 10, 15, 16, is_map=True)  # fewer than two per worker left
    assert prefetch_wanted(0.001, 10, 1, 16, is_map=False)  # 10 ms batches
    assert not prefetch_wanted(0.01, 10, 1000, 16, is_map=False)  # 100 ms: not behind a busy worker
    assert runs_long(None, 1) and runs_long(0.05, 1) and not runs_long(0.001, 10)


def test_a_map_goes_from_batch_to_batch_without_waiting_for_the_master_unless_they_run_long() -> None:
    # A map's batches, sized to MAP_BATCH_SECONDS, take the next one behind them ...
    assert not runs_long(0.1, int(MAP_BATCH_SECONDS / 0.1), is_map=True)
    assert not runs_long(0.01, 10, is_map=True)
    # ... where other calls' work waits for them to end,
    assert runs_long(0.01, 10, is_map=False)
    # and nothing waits behind a batch whose time is unknown or past twice a map's batch.
    assert runs_long(None, 1, is_map=True)
    assert runs_long(2 * MAP_BATCH_SECONDS, 1, is_map=True)


def test_workers_start_in_runs_of_half_the_burst_not_one_as_each_becomes_ready() -> None:
    assert starts_now(64, 0, 16) == 16  # the first run fills the burst
    assert starts_now(48, 15, 16) == 0  # one became ready: wait for more room
    assert starts_now(48, 8, 16) == 8  # half the burst is free
    assert starts_now(3, 14, 16) == 0 and starts_now(3, 13, 16) == 3  # the last few, at once
    assert starts_now(5, 0, None) == 5  # no bound (workers on other machines)
    assert starts_now(5, 1, 2) == 1  # a burst of 2 (one per CPU): one at a time, as before
    assert starts_now(0, 0, 16) == 0 and starts_now(-1, 0, None) == 0
