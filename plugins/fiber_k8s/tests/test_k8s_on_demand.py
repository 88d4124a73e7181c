"""Flyte's rule on Kubernetes: a Pool task whose spot worker pods were preempted
``on_demand_after`` times runs its next attempt on an on-demand node, on an emulator of its own
with a tainted spot node and an on-demand node (the decisions: tests/test_pool_on_demand.py).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fiber_core
import pod_functions
import pytest
from fiber_core.contract import EndReason
from fiber_core.runtime.config import config
from fiber_core.runtime.run import runtime
from k8s_helpers import (
    WAIT,
    Emu,
    emulator_with_nodes,
    tree_in_pods_environment,
    use_environment,
)
from kubernetes import client

from fiber_k8s.spec import SPOT_LABELS

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[3]
SPOT = {"key": "cloud.google.com/gke-spot", "value": "true", "effect": "NoSchedule"}
NODES = [
    {"name": "spot-node", "labels": {"cloud.google.com/gke-spot": "true"}, "allocatable": {"cpu": "8"},
     "taints": [SPOT]},
    {"name": "on-demand-node", "allocatable": {"cpu": "8"}},
]


@pytest.fixture(scope="module")
def spot_emu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emu]:
    """An emulator of this module's own: one spot node (labelled and tainted as on GKE), one on-demand."""
    tmp = tmp_path_factory.mktemp("k8s-spot-emulator")
    with emulator_with_nodes(tmp, NODES) as emu:
        yield emu


@pytest.fixture
def spot_env(spot_emu: Emu, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The kubernetes backend on ``spot_emu``, with this tree's fiber_core in the pods."""
    env = tree_in_pods_environment(spot_emu, REPO, fallback_wait="5", spot_label=SPOT_LABELS["gke"])
    use_environment(env, monkeypatch)
    yield env
    runtime().get_backend("kubernetes").cleanup()
    config.reset()


def running_it(pool: fiber_core.Pool, before: set[int]) -> Any:
    """The worker of ``pool`` (none of ``before``) that holds the pool's one task, once one does
    (polled: the pool's table has no event to wait on)."""
    deadline = time.monotonic() + WAIT
    while True:
        with pool._lock:
            found = [w for w in pool._workers.values() if w.id not in before and w.pending and w.ready
                     and not w.lost and not w.draining and w.process.job is not None]
        if found:
            return found[0]
        assert time.monotonic() < deadline, "no spot worker ran the task"
        threading.Event().wait(0.05)


def workers_gone(pool: fiber_core.Pool) -> bool:
    with pool._lock:
        return not pool._workers


def test_a_task_preempted_twice_on_spot_runs_its_next_attempt_on_an_on_demand_node(
        spot_env: dict[str, str], spot_emu: Emu) -> None:
    v1 = client.CoreV1Api(spot_emu.api_client)
    with fiber_core.Pool(1, backend="kubernetes", capacity="spot-then-on-demand", on_demand_after=2,
                         idle_timeout=1) as pool:
        result = pool.apply_async(pod_functions.on_demand_only)
        seen: set[int] = set()
        for _ in range(2):
            worker = running_it(pool, seen)
            seen.add(worker.id)
            job = worker.process.job
            assert job.host == "spot-node"
            v1.create_namespaced_pod_eviction(job.id, "default", client.V1Eviction(
                metadata=client.V1ObjectMeta(name=job.id), delete_options=client.V1DeleteOptions(grace_period_seconds=1)))
            worker.process.join(WAIT)
            assert job.state.reason is EndReason.PREEMPTED, job.state
        record = json.loads(result.get(2 * WAIT))
        assert (record["capacity"], record["host"]) == ("on-demand", "on-demand-node")
        on_demand = pool._on_demand
        assert on_demand is not None and [p.name for p in on_demand._pool] == ["PoolWorker-on-demand-1"]
        # The pool's own workers stay on spot capacity: the next task runs there ...
        assert json.loads(pool.apply(pod_functions.resources))["capacity"] == "spot"
        # ... and the on-demand worker, idle for the pool's idle_timeout, goes.
        deadline = time.monotonic() + WAIT
        while not workers_gone(on_demand):  # polled: no event says it
            assert time.monotonic() < deadline, "the idle on-demand worker did not go"
            threading.Event().wait(0.1)
