"""Heartbeats and use samples, without workers: ``pool/liveness.py`` and ``base/usage.py``."""

from __future__ import annotations

import hashlib
import time

import pytest

from fiber_core.base import usage
from fiber_core.parallel.pool.liveness import (
    HEARTBEATS_PER_TIMEOUT,
    MAX_INTERVAL,
    MIN_INTERVAL,
    USAGE_HISTORY,
    UsageLog,
    heartbeat_interval,
    silent,
)


@pytest.mark.parametrize("timeout,interval", [
    (15.0, 15.0 / HEARTBEATS_PER_TIMEOUT),
    (1.0, 1.0 / HEARTBEATS_PER_TIMEOUT),
    (0.01, MIN_INTERVAL),  # a tiny bound sends no flood
    (3600.0, MAX_INTERVAL),  # a huge one still refreshes the live view
    (0.0, 0.0),  # none
])
def test_the_heartbeat_interval_follows_the_bound(timeout: float, interval: float) -> None:
    assert heartbeat_interval(timeout) == pytest.approx(interval)


def test_a_worker_is_silent_only_past_the_bound_and_never_without_one() -> None:
    assert not silent(100.0, 110.0, 15.0)
    assert not silent(100.0, 115.0, 15.0)
    assert silent(100.0, 115.5, 15.0)
    assert not silent(100.0, 10_000.0, 0.0)  # heartbeat_timeout = 0: no bound


def test_the_usage_log_keeps_the_latest_sample_and_a_bounded_history_oldest_first() -> None:
    log = UsageLog()
    assert log.view(5.0) == {"usage": None, "usage_history": []}
    for i in range(USAGE_HISTORY + 10):
        log.add(float(i), {"cpu": float(i), "rss": 1000 + i, "gpu": None, "gpu_memory": None})
    now = float(USAGE_HISTORY + 10)
    view = log.view(now)
    assert view["usage"] == {"cpu": USAGE_HISTORY + 9.0, "rss": 1009 + USAGE_HISTORY,
                             "gpu": None, "gpu_memory": None}
    history = view["usage_history"]
    assert len(history) == USAGE_HISTORY
    assert history[0] == [now - 10, 10.0, 1010]  # the ten oldest are gone
    assert history[-1] == [1.0, USAGE_HISTORY + 9.0, 1009 + USAGE_HISTORY]
    assert [h[0] for h in history] == sorted((h[0] for h in history), reverse=True)


def test_a_sample_measures_this_processs_cpu_and_memory() -> None:
    sampler = usage.Sampler()
    buf = b"x" * (1 << 20)
    end = time.process_time() + 0.2
    while time.process_time() < end:  # busy: the next sample's CPU is well above nothing
        hashlib.sha256(buf).digest()
    busy = sampler.sample()
    assert busy["cpu"] > 0.0
    assert busy["rss"] is not None and busy["rss"] > len(buf)
    time.sleep(0.2)  # idle: the time measured, not synchronisation
    idle = sampler.sample()
    assert idle["cpu"] < busy["cpu"]
    assert set(idle) == {"cpu", "rss", "gpu", "gpu_memory"}


def test_without_nvml_the_gpu_is_none() -> None:
    try:
        import pynvml  # noqa: F401
    except ImportError:
        assert usage.Gpu().read(time.monotonic()) == (None, None)
    else:
        pytest.skip("pynvml is installed here")
