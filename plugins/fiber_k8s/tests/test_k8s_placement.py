"""GPU alternatives on Kubernetes: one pod per alternative, in order, each after
``fallback_wait``, on an emulator of its own whose nodes carry different GPU labels, taints and
counts (the scheduler's filters decide, as kube-scheduler's would: ``k8s_emulator/README.md``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fiber_core
import pod_functions
import pytest
from fiber_core.contract import ConfigError, EndReason, GpuChoice, JobSpec
from fiber_core.runtime.config import config
from fiber_core.runtime.run import runtime
from k8s_helpers import (
    WAIT,
    Emu,
    emulator_with_nodes,
    tree_in_pods_environment,
    use_environment,
)

from fiber_k8s.backend import KubernetesBackend
from fiber_k8s.spec import DEFAULT_GPU_LABEL, SPOT_LABELS, capacity_terms, choice_spec, require_node

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[3]
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
NODES = [
    {"name": "cpu-node", "allocatable": {"cpu": "8"}},
    {"name": "a100-node", "labels": {DEFAULT_GPU_LABEL: "a100"}, "allocatable": {"nvidia.com/gpu": 1},
     "taints": [GPU_TAINT]},
    {"name": "l4-node", "labels": {DEFAULT_GPU_LABEL: "l4"}, "allocatable": {"nvidia.com/gpu": 2},
     "taints": [GPU_TAINT]},
    {"name": "l4-spot", "labels": {DEFAULT_GPU_LABEL: "l4", "cloud.google.com/gke-spot": "true"},
     "allocatable": {"nvidia.com/gpu": 1},
     "taints": [GPU_TAINT, {"key": "cloud.google.com/gke-spot", "value": "true", "effect": "NoSchedule"}]},
]
SHOW = ("import os; print('GOT', os.environ['FIBER_RESOURCES'], os.environ['FIBER_NODE'], "
        "os.environ.get('POD_NAME'), flush=True)")


@pytest.fixture(scope="module")
def gpu_emu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emu]:
    """An emulator of this module's own, with a CPU node, one A100 and two L4s (tainted)."""
    tmp = tmp_path_factory.mktemp("k8s-gpu-emulator")
    with emulator_with_nodes(tmp, NODES) as emu:
        yield emu


@pytest.fixture
def gpu_env(gpu_emu: Emu, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The kubernetes backend on ``gpu_emu``, with this tree's fiber_core in the pods (mounted
    and first on PYTHONPATH), so that a job reads ``current_process().resources`` as here."""
    env = tree_in_pods_environment(gpu_emu, REPO, fallback_wait="1", spot_label=SPOT_LABELS["gke"])
    use_environment(env, monkeypatch)
    yield env
    runtime().get_backend("kubernetes").cleanup()
    config.reset()


@pytest.fixture
def backend(gpu_env: dict[str, str]) -> Iterator[KubernetesBackend]:
    b = KubernetesBackend(config.backend_settings("kubernetes"), "t" + uuid.uuid4().hex[:10])
    yield b
    b.cleanup()


def got(backend: KubernetesBackend, job: Any) -> tuple[dict[str, Any], str]:
    """What the job printed: its resource record and its node."""
    line = next(ln for ln in backend.get_job_logs(job).splitlines() if ln.startswith("GOT "))
    _, record, node, _pod = line.split(" ", 3)
    return json.loads(record), node


def test_the_pod_of_each_alternative_asks_for_its_type_and_count_only() -> None:
    spec = JobSpec(command=["true"], gpu_type=["a100", ("l4", 2)])  # type: ignore[arg-type]
    second = choice_spec(spec, 1)
    assert (second.gpu_type, second.gpu, second.gpu_choices) == ("l4", 2, (GpuChoice("l4", 2),))
    assert json.loads(second.env["FIBER_RESOURCES"])["gpu_type"] == "l4"
    assert choice_spec(JobSpec(command=["true"]), 0).gpu_choices == ()


def test_an_absent_first_type_gives_way_to_the_second_within_the_wait(backend: KubernetesBackend) -> None:
    job = backend.start_job(JobSpec(command=["python3", "-c", SHOW], name="learner",
                                    gpu_type=["h100", ("l4", 2)]))  # type: ignore[arg-type]
    first = job.id
    assert backend.wait_for_job(job, WAIT) == 0, backend.get_job_logs(job)
    record, node = got(backend, job)
    assert job.id != first and job.host == node == "l4-node"
    assert (record["gpu_type"], record["gpu"]) == ("l4", 2)


def test_a_full_first_type_gives_way_to_the_second(backend: KubernetesBackend) -> None:
    holder = backend.start_job(JobSpec(command=["python3", "-c", "import time; time.sleep(600)"], name="holder",
                                       gpu=1, gpu_type="a100"))
    assert backend.wait_started(holder, WAIT) is None and holder.host == "a100-node"
    job = backend.start_job(JobSpec(command=["python3", "-c", SHOW], name="learner", gpu_type=["a100", "l4"]))  # type: ignore[arg-type]
    assert backend.wait_for_job(job, WAIT) == 0, backend.get_job_logs(job)
    assert got(backend, job)[0]["gpu_type"] == "l4" and job.host == "l4-node"
    backend.stop_job(holder, force=True)


def test_the_first_type_is_used_when_it_has_room(backend: KubernetesBackend) -> None:
    job = backend.start_job(JobSpec(command=["python3", "-c", SHOW], name="learner", gpu_type=["a100", "l4"]))  # type: ignore[arg-type]
    first = job.id
    assert backend.wait_for_job(job, WAIT) == 0, backend.get_job_logs(job)
    assert job.id == first and got(backend, job)[0]["gpu_type"] == "a100" and job.host == "a100-node"


def test_when_no_alternative_fits_the_job_fails_naming_what_it_tried(gpu_env: dict[str, str]) -> None:
    b = KubernetesBackend({**config.backend_settings("kubernetes"), "schedule_timeout": 1.0},
                          "t" + uuid.uuid4().hex[:10])
    try:
        job = b.start_job(JobSpec(command=["true"], name="x", gpu_type=["h100", ("l4", 3)]))  # type: ignore[arg-type]
        assert b.wait_for_job(job, WAIT) == 1
        assert job.state.reason is EndReason.NEVER_STARTED
        assert "after h100:1, each for fallback_wait=1s" in job.state.detail
        assert "Insufficient nvidia.com/gpu" in job.state.detail
    finally:
        b.cleanup()


def test_a_pool_worker_knows_the_gpu_node_and_price_it_got(gpu_env: dict[str, str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FIBER_PRICES", "h100:9, l4:1.25")
    config.reset()
    with fiber_core.Pool(1, backend="kubernetes", gpu_type=["h100", "l4"]) as pool:
        record = json.loads(pool.apply(pod_functions.resources))
    assert record == {"gpu_type": "l4", "gpu": 1, "capacity": None, "cost_per_hour": 1.25, "host": "l4-node"}


def test_capacity_kinds_become_node_affinity_and_a_toleration_of_the_spot_label() -> None:
    spot, tolerate = capacity_terms("spot", "eks.amazonaws.com/capacityType=SPOT")
    assert spot == [{"key": "eks.amazonaws.com/capacityType", "operator": "In", "values": ["SPOT"]}]
    assert tolerate == [{"key": "eks.amazonaws.com/capacityType", "operator": "Exists", "effect": "NoSchedule"}]
    on_demand, none = capacity_terms("on-demand", "eks.amazonaws.com/capacityType=SPOT")
    assert on_demand == [{"key": "eks.amazonaws.com/capacityType", "operator": "NotIn", "values": ["SPOT"]}]
    assert none == [] and capacity_terms(None, None) == ([], [])
    with pytest.raises(ConfigError, match=r"needs \[kubernetes\] spot_label.*GKE: cloud.google.com/gke-spot=true"):
        capacity_terms("spot", None)
    # A template's own required terms are ORed: each of them must keep the pod on its kind.
    pod = {"spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                              {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}]}}}}}
    terms = require_node(pod, spot)["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert all(t["matchExpressions"][-1] == spot[0] for t in terms) and len(terms) == 2
    alternatives = JobSpec(command=[], gpu_type=["a100", "l4"], capacity="spot-then-on-demand").alternatives  # type: ignore[arg-type]
    assert [str(a) for a in alternatives] == ["a100:1 spot", "l4:1 spot", "a100:1 on-demand", "l4:1 on-demand"]


def test_a_spot_job_runs_on_a_spot_node_and_knows_it(backend: KubernetesBackend) -> None:
    job = backend.start_job(JobSpec(command=["python3", "-c", SHOW], name="learner", gpu_type="l4", capacity="spot"))
    assert backend.wait_for_job(job, WAIT) == 0, backend.get_job_logs(job)
    record, node = got(backend, job)
    assert node == "l4-spot" and (record["gpu_type"], record["capacity"]) == ("l4", "spot")


def test_spot_then_on_demand_moves_to_on_demand_when_spot_is_full(backend: KubernetesBackend) -> None:
    holder = backend.start_job(JobSpec(command=["python3", "-c", "import time; time.sleep(600)"], name="holder",
                                       gpu_type="l4", capacity="spot"))
    assert backend.wait_started(holder, WAIT) is None and holder.host == "l4-spot"
    job = backend.start_job(JobSpec(command=["python3", "-c", SHOW], name="learner", gpu_type="l4",
                                    capacity="spot-then-on-demand"))
    assert backend.wait_for_job(job, WAIT) == 0, backend.get_job_logs(job)
    record, node = got(backend, job)
    assert node == "l4-node" and (record["gpu_type"], record["capacity"]) == ("l4", "on-demand")
    backend.stop_job(holder, force=True)


def test_the_emulator_keeps_an_on_demand_pod_off_an_untainted_spot_node() -> None:
    """What the pod asks of its node decides, as kube-scheduler's NodeAffinity filter: a GKE
    spot node need not be tainted, so the affinity alone must keep on-demand pods off it."""
    from k8s_emulator.kubelet import schedule
    from k8s_emulator.store import node_object

    spot = node_object({"name": "spot", "labels": {"cloud.google.com/gke-spot": "true"}})
    plain = node_object({"name": "plain"})
    expressions, _ = capacity_terms("on-demand", SPOT_LABELS["gke"])
    pod = require_node({"spec": {"containers": [{"name": "job"}]}, "status": {}}, expressions)
    assert schedule(pod, [spot, plain], []) == ("plain", "")
    node, why = schedule(pod, [spot], [])
    assert node is None and "didn't match Pod's node affinity/selector" in why
    spot_pod = require_node({"spec": {"containers": [{"name": "job"}]}, "status": {}},
                            capacity_terms("spot", SPOT_LABELS["gke"])[0])
    assert schedule(spot_pod, [plain, spot], [])[0] == "spot"
