"""The live view's history of a pool (pure): throughput over time, timelines, losses, all bounded."""

from __future__ import annotations

import json
import threading

from fiber_core.parallel.pool import history
from fiber_core.parallel.pool.history import (
    COARSE_BUCKETS,
    ENDED_WORKERS,
    EVENTS_PER_WORKER,
    FINE_SECONDS,
    LOSS_LINES,
    LOSSES_KEPT,
    Throughput,
    Timeline,
    output_lines_per_worker,
)

T0 = 1000.0  # a monotonic clock's reading


def test_throughput_is_kept_per_second_and_its_rate_covers_the_window_asked() -> None:
    t = Throughput()
    for i in range(20):
        t.add(T0 + i + 0.5, 10)
        t.add(T0 + i + 0.7, 5)  # the same second: added to it
    assert t.series(T0 + 20) == [[round(20 - i, 1), 15, 1] for i in range(20)]
    assert t.rate(T0 + 20, 10, since=T0) == 15.0
    young = Throughput()
    for i in range(5):
        young.add(T0 + i, 10)
    assert young.rate(T0 + 5, 10, since=T0) == 10.0  # a pool 5 s old: over its 5 s
    assert young.rate(T0, 10, since=T0) == 0.0


def test_throughput_older_than_ten_minutes_is_kept_per_minute_and_a_long_run_stays_small() -> None:
    t = Throughput()
    seconds = FINE_SECONDS + 3 * 60
    for i in range(seconds):
        t.add(T0 + i, 2)
    now = T0 + seconds
    points = t.series(now)
    coarse = [p for p in points if p[2] == 60]
    fine = [p for p in points if p[2] == 1]
    assert len(fine) == FINE_SECONDS
    assert sum(p[1] * 60 for p in coarse) == 2 * (seconds - FINE_SECONDS)  # nothing lost
    assert all(a[0] > b[0] for a, b in zip(points, points[1:]))  # the oldest first

    # A day and more, a task a second: a day of minutes and ten minutes of seconds, no more.
    for i in range(seconds, seconds + 2 * 24 * 3600, 7):
        t.add(T0 + i, 1)
    assert len(t.series(T0 + seconds + 2 * 24 * 3600)) <= COARSE_BUCKETS + FINE_SECONDS


def test_a_timeline_keeps_changes_only_and_a_bounded_number_of_them() -> None:
    tl = Timeline()
    tl.observe(T0, 1, "PoolWorker-1", None, None, "starting")
    tl.observe(T0 + 1, 1, "PoolWorker-1", "123", "h", "busy")
    tl.observe(T0 + 2, 1, "PoolWorker-1", "123", "h", "busy")  # no change: not kept
    tl.observe(T0 + 3, 1, "PoolWorker-1", None, None, "idle")
    [w] = tl.view(T0 + 4)["timeline"]
    assert w == {"name": "PoolWorker-1", "id": "123", "host": "h", "started_ago": 4.0,
                 "events": [[4.0, "starting"], [3.0, "busy"], [1.0, "idle"]], "end": None}
    for i in range(10 * EVENTS_PER_WORKER):
        tl.observe(T0 + 10 + i, 1, "PoolWorker-1", "123", "h", "busy" if i % 2 else "idle")
    [w] = tl.view(T0 + 1000)["timeline"]
    assert len(w["events"]) == EVENTS_PER_WORKER and w["events"][-1][1] == "busy"


def test_a_lost_worker_keeps_its_reason_its_last_lines_and_is_in_the_losses() -> None:
    tl = Timeline()
    tl.observe(T0, 1, "PoolWorker-1", "11", "h", "busy")
    tl.observe(T0, 2, "PoolWorker-2", "12", "h", "busy")
    lines = [f"line {i}" for i in range(30)]
    tl.ended(T0 + 5, 1, "PoolWorker-1", "11", "h", reason="oom", lost=True, lines=lines,
             description="PoolWorker-1 was killed: out of memory")
    tl.ended(T0 + 6, 2, "PoolWorker-2", "12", "h", reason="retired", lost=False, lines=[],
             description="PoolWorker-2 exited with code 0")
    view = tl.view(T0 + 10)
    assert [w["name"] for w in view["timeline"]] == ["PoolWorker-2", "PoolWorker-1"]  # last ended first
    lost = view["timeline"][1]
    assert lost["end"] == {"reason": "oom", "description": "PoolWorker-1 was killed: out of memory",
                           "lost": True, "ago": 5.0}
    assert lost["events"][-1] == [5.0, "lost"]
    assert view["timeline"][0]["events"][-1] == [4.0, "ended"]
    [loss] = view["loss_log"]  # a retired worker is no loss
    assert loss == {"worker": "PoolWorker-1", "id": "11", "host": "h", "reason": "oom",
                    "description": "PoolWorker-1 was killed: out of memory",
                    "output": lines[-LOSS_LINES:], "ago": 5.0}


def test_a_worker_sampled_as_lost_before_its_end_came_has_one_lost_event() -> None:
    tl = Timeline()
    tl.observe(T0, 1, "PoolWorker-1", "11", "h", "busy")
    tl.observe(T0 + 1, 1, "PoolWorker-1", "11", "h", "lost")
    tl.ended(T0 + 2, 1, "PoolWorker-1", "11", "h", reason="oom", lost=True, lines=[], description="oom")
    [w] = tl.view(T0 + 3)["timeline"]
    assert w["events"] == [[3.0, "busy"], [1.0, "lost"]]


def test_a_worker_lost_before_it_was_ever_seen_has_a_timeline_too() -> None:
    tl = Timeline()
    tl.ended(T0, 7, "PoolWorker-7", None, None, reason="never_started", lost=True, lines=[],
             description="PoolWorker-7 never started")
    [w] = tl.view(T0 + 1)["timeline"]
    assert w["name"] == "PoolWorker-7" and w["end"]["reason"] == "never_started"


def test_512_workers_and_thousands_of_losses_keep_the_view_small() -> None:
    tl = Timeline()
    t = Throughput()
    line = "x" * 300
    for wid in range(1, 10_001):  # 512 live at any time, the others lost
        at = T0 + wid
        for k in range(EVENTS_PER_WORKER + 5):
            tl.observe(at + k / 100, wid, f"PoolWorker-{wid}", str(wid), "h", ("busy", "idle")[k % 2])
        if wid > 512:
            tl.ended(at, wid - 512, f"PoolWorker-{wid - 512}", str(wid - 512), "h", reason="killed",
                     lost=True, lines=[line] * 50, description="killed")
        t.add(at, 100)
    view = tl.view(T0 + 20_000)
    assert len(view["timeline"]) == 512 + ENDED_WORKERS
    assert len(view["loss_log"]) == LOSSES_KEPT
    size = len(json.dumps({**view, "throughput_history": t.series(T0 + 20_000)}))
    assert size < 1_000_000, size


def test_a_snapshot_shows_fewer_lines_per_worker_as_the_pool_grows_but_never_none() -> None:
    assert output_lines_per_worker(0) == 50 and output_lines_per_worker(3) == 50
    assert output_lines_per_worker(512) == history.SNAPSHOT_OUTPUT_LINES // 512
    assert output_lines_per_worker(100_000) == history.MIN_OUTPUT_LINES
    assert output_lines_per_worker(3, most=10) == 10


def test_the_throughput_is_read_safely_while_another_thread_adds_to_it() -> None:
    t = Throughput()
    done = threading.Event()
    errors: list[BaseException] = []

    def read() -> None:
        try:
            while not done.is_set():
                t.series(T0 + 10_000)
                t.rate(T0 + 10_000, 10, since=T0)
        except BaseException as e:  # what the view would have raised
            errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(300_000):
            t.add(T0 + i / 30, 1)  # a new second every 30 adds: the deques change
    finally:
        done.set()
        reader.join()
    assert errors == []
