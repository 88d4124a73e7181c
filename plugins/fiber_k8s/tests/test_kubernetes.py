"""The ``kubernetes`` backend against the Kubernetes API emulator (a real HTTP API server and a
test kubelet running each pod as a host-network container on the test dockerd; see
``k8s_emulator/README.md``). Nothing is mocked: the plugin talks to it through a kubeconfig.

Jobs run the ``fiber-test`` image (Python 3.11 + fiber-core). Functions that pool workers
import by name live in ``pod_functions.py``; the ``k8s_env`` fixture mounts the tests
directory at the same path in every pod through the ``volumes`` setting (a hostPath), so
they import there as here.
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fiber_core
import pod_functions
import pytest
import yaml
from fiber_core.contract import BackendError, EndReason, JobSpec
from fiber_core.runtime.config import config, plugins, selected_backend_name
from fiber_core.runtime.run import runtime
from fiber_core.testing import BackendConformance, failing_program
from k8s_helpers import SERVICES, WAIT, Emu, start_emulator, unschedulable
from kubernetes import client, watch

from fiber_k8s import rbac
from fiber_k8s.backend import (
    KubernetesBackend,
    label_value,
)

pytestmark = pytest.mark.timeout(300)


class TestKubernetes(BackendConformance):
    """The shared conformance suite, with every job a pod on the emulator."""

    backend_name = "kubernetes"
    python = "python3"
    start_timeout = float(WAIT)

    @pytest.fixture(autouse=True)
    def _env(self, k8s_env: dict[str, str], image: str) -> None:
        pass


# -- helpers ------------------------------------------------------------------------------------


def settings(**overrides: Any) -> dict[str, Any]:
    """The backend's settings as configured by ``k8s_env``, with ``overrides``."""
    return {**config.backend_settings("kubernetes"), **overrides}


@pytest.fixture
def backend(k8s_env: dict[str, str], image: str) -> Iterator[KubernetesBackend]:
    """A backend of its own run; the pods it starts can run (``image``)."""
    b = KubernetesBackend(settings(), "t" + uuid.uuid4().hex[:10])
    yield b
    b.cleanup()


def job_spec(code: str, **kw: Any) -> JobSpec:
    kw.setdefault("name", "test-job")
    return JobSpec(command=["python3", "-c", code], **kw)


def run_pods(v1: client.CoreV1Api, ns: str, selector: str) -> list[client.V1Pod]:
    return v1.list_namespaced_pod(ns, label_selector=selector).items


def wait_pods(v1: client.CoreV1Api, ns: str, selector: str, until: Callable[[list[client.V1Pod]], bool],
              what: str) -> list[client.V1Pod]:
    """Watch the pods of ``selector`` until ``until(pods)`` holds; fail after WAIT seconds."""
    listed = v1.list_namespaced_pod(ns, label_selector=selector)
    pods = {p.metadata.name: p for p in listed.items}
    if until(list(pods.values())):
        return list(pods.values())
    w = watch.Watch()
    for ev in w.stream(v1.list_namespaced_pod, ns, label_selector=selector,
                       resource_version=listed.metadata.resource_version, timeout_seconds=WAIT,
                       _request_timeout=WAIT + 5):
        p = ev["object"]
        if ev["type"] == "DELETED":
            pods.pop(p.metadata.name, None)
        else:
            pods[p.metadata.name] = p
        if until(list(pods.values())):
            w.stop()
            return list(pods.values())
    raise AssertionError(f"pods of {selector} did not get {what} in {WAIT} s: "
                         f"{[(p.metadata.name, p.status.phase) for p in pods.values()]}")


def script_env(k8s_env: dict[str, str], **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FIBER_") and k != "KUBERNETES_SERVICE_HOST"}
    return {**env, **k8s_env, "FIBER_BACKEND": "kubernetes", **extra}


# -- registration and selection -------------------------------------------------------------------


def test_registered_as_kubernetes_and_k8s() -> None:
    assert plugins().get_class("kubernetes") is KubernetesBackend
    assert plugins().get_class("k8s") is KubernetesBackend
    info = next(i for i in plugins().backends() if i.name == "kubernetes")
    assert info.package == "fiber-k8s" and info.aliases == ("k8s",)


def test_selected_by_itself_in_a_pod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing configured: the plugin's fiber_detect_backend answers kubernetes in a pod only.
    monkeypatch.chdir(tmp_path)  # no .fiberconfig
    for key in [k for k in os.environ if k.startswith("FIBER_")]:
        monkeypatch.delenv(key)
    try:
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
        config.reset()
        assert selected_backend_name() == "kubernetes"
        monkeypatch.setenv("FIBER_BACKEND", "local")  # what is configured wins
        assert selected_backend_name() == "local"
        monkeypatch.delenv("FIBER_BACKEND")
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
        config.reset()
        assert selected_backend_name() == "local"
    finally:
        config.reset()


def test_selected_by_itself_in_a_real_pod(backend: KubernetesBackend, pod_site: Path) -> None:
    # A pod of the emulator has KUBERNETES_SERVICE_HOST from its kubelet, as on a cluster.
    code = "from fiber_core.runtime.config import selected_backend_name as s; print('backend', s())"
    job = backend.start_job(job_spec(code, env={"PYTHONPATH": str(pod_site)},
                                     backend_options={"volumes": [f"{pod_site}:{pod_site}:ro"]}))
    assert backend.wait_for_job(job, WAIT) == 0, backend.get_job_logs(job)
    assert "backend kubernetes" in backend.get_job_logs(job)


# -- the pod manifest -----------------------------------------------------------------------------


def test_gpu_resources_selector_and_labels_in_the_created_pod(
        emu: Emu, v1: client.CoreV1Api, ns: str, backend: KubernetesBackend, restore_config: None) -> None:
    spec = job_spec("print('on a gpu node')", name="Process-1:2 weird/name", cpu=0.5, memory=300, gpu=2,
                    gpu_type="NVIDIA-A100-SXM4-40GB", labels={"fiber.run": backend.run_id, "fiber.name": "x"})
    job = backend.start_job(spec)
    created = v1.read_namespaced_pod(job.id, ns)  # read back what the API server stored
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", job.id) and len(job.id) <= 63
    assert job.id.startswith("process-1-2-weird-name-" + backend.run_id + "-")
    res = created.spec.containers[0].resources
    assert res.limits == {"cpu": "500m", "memory": "300Mi", "nvidia.com/gpu": "2"}
    assert res.requests == {"cpu": "500m", "memory": "300Mi", "nvidia.com/gpu": "2"}  # GPU: defaulted
    assert created.spec.node_selector == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"}
    assert any(t.key == "nvidia.com/gpu" and t.operator == "Exists" for t in created.spec.tolerations)
    assert created.spec.restart_policy == "Never"
    assert created.metadata.labels["fiber.run"] == backend.run_id
    assert created.metadata.labels["fiber.parent"] == backend.selector.split("fiber.parent=")[1]
    assert created.metadata.labels["fiber.name"] == "Process-1_2_weird_name"
    assert created.metadata.annotations["fiber.name"] == "Process-1:2 weird/name"
    assert created.metadata.owner_references is None  # this parent is not a pod
    # No node has GPUs: the pod waits. A node with the label and two GPUs takes it.
    assert backend.wait_for_job(job, 0.5) is None
    nodes = emu.admin("config")["nodes"]
    emu.admin("config", {"nodes": nodes + [{"name": "a100", "labels": {
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"}, "allocatable": {"nvidia.com/gpu": 2}}]}, "PUT")
    assert backend.wait_for_job(job, WAIT) == 0, backend.get_job_logs(job)
    assert job.host == "a100"


# -- failures that must not hang ------------------------------------------------------------------


def test_image_pull_failure_fails_the_job_with_the_reason(v1: client.CoreV1Api, ns: str,
                                                          backend: KubernetesBackend) -> None:
    job = backend.start_job(job_spec("pass", image="fiber-no-such-image:1"))
    assert backend.wait_for_job(job, WAIT) == 1
    logs = backend.get_job_logs(job)
    assert "ErrImagePull" in logs and "fiber-no-such-image:1" in logs
    assert job.state.reason is EndReason.NEVER_STARTED
    # The pod is deleted, so the kubelet stops retrying the pull.
    wait_pods(v1, ns, f"fiber.run={backend.run_id}", lambda pods: not pods, "deleted")


def test_image_pull_failure_of_a_process(k8s_env: dict[str, str], image: str, caplog: pytest.LogCaptureFixture) -> None:
    p = fiber_core.Process(target=pod_functions.square, args=(2,), backend="kubernetes",
                           image="fiber-no-such-image:2")
    with caplog.at_level(logging.WARNING, logger="fiber"):
        p.start()
        p.join(WAIT)
    assert p.exitcode == 1
    assert "ErrImagePull" in caplog.text and "fiber-no-such-image:2" in caplog.text


def test_image_without_python_fails_with_its_log(backend: KubernetesBackend) -> None:
    job = backend.start_job(job_spec("pass", image="fiber-test-nopython:latest"))
    assert backend.wait_for_job(job, WAIT) == 127  # sh: python3: not found
    assert "python3" in backend.get_job_logs(job)


def test_out_of_memory_is_sigkill_with_the_reason(backend: KubernetesBackend) -> None:
    job = backend.start_job(job_spec("x = bytearray(400 * 2**20); print('survived')", memory=64))
    assert backend.wait_for_job(job, WAIT) == -signal.SIGKILL
    logs = backend.get_job_logs(job)
    assert "OOMKilled" in logs and "survived" not in logs
    assert job.state.reason is EndReason.OOM and "memory limit of 64Mi" in job.state.detail


def test_a_container_sigkilled_on_its_node_is_killed_not_out_of_memory(backend: KubernetesBackend,
                                                                      v1: client.CoreV1Api, ns: str) -> None:
    """SIGKILL from the node (here ``docker kill``, as an operator or a node agent would): the
    kubelet reports exitCode 137 with reason ``Error``, not ``OOMKilled``, and the job ends KILLED."""
    import docker

    job = backend.start_job(job_spec("import time; print('up', flush=True); time.sleep(600)"))

    def running(pods: list[client.V1Pod]) -> bool:
        statuses = [cs for p in pods if p.metadata.name == job.id for cs in p.status.container_statuses or []]
        return any(cs.state.running and cs.container_id for cs in statuses)

    pod = next(p for p in wait_pods(v1, ns, f"fiber.run={backend.run_id}", running, "its container running")
               if p.metadata.name == job.id)
    cid = pod.status.container_statuses[0].container_id.removeprefix("docker://")
    docker_host = os.environ.get("FIBER_K8S_DOCKER_HOST") or f"unix://{SERVICES / 'docker' / 'docker.sock'}"
    docker.APIClient(base_url=docker_host, timeout=60).kill(cid, signal="SIGKILL")
    assert backend.wait_for_job(job, WAIT) == -signal.SIGKILL
    assert job.state.reason is EndReason.KILLED, job.state
    assert "not for memory" in job.state.detail


def test_unschedulable_pod_fails_after_schedule_timeout(v1: client.CoreV1Api, ns: str,
                                                        k8s_env: dict[str, str]) -> None:
    b = KubernetesBackend(settings(schedule_timeout=1.0), "t" + uuid.uuid4().hex[:10])
    try:
        job = b.start_job(job_spec("pass", gpu=1))
        assert b.wait_for_job(job, WAIT) == 1
        logs = b.get_job_logs(job)
        assert "schedule_timeout=1s" in logs and "Insufficient nvidia.com/gpu" in logs
        assert job.state.reason is EndReason.NEVER_STARTED
        wait_pods(v1, ns, f"fiber.run={b.run_id}", lambda pods: not pods, "deleted")
    finally:
        b.cleanup()


def test_log_of_a_pod_with_no_node_is_empty_then_says_why(emu: Emu, v1: client.CoreV1Api, ns: str,
                                                        k8s_env: dict[str, str], restore_config: None) -> None:
    # The API answers 204 with no body while a pod has no node. Without the delete verb the
    # pod stays after its job failed, so the log is read from it then too.
    rules = role_rules()
    rules["pods"] = [v for v in rules["pods"] if v not in ("delete", "deletecollection")]
    emu.admin("config", {"rbac": rules}, "PUT")
    b = KubernetesBackend(settings(schedule_timeout=1.0), "t" + uuid.uuid4().hex[:10])
    try:
        job = b.start_job(job_spec("pass", gpu=1))
        assert b.get_job_logs(job) == ""  # not scheduled yet: no logs yet
        assert b.wait_for_job(job, WAIT) == 1
        assert run_pods(v1, ns, f"fiber.run={b.run_id}")  # still there: its log is 204 again
        logs = b.get_job_logs(job)
        assert logs.startswith("fiber: pod ") and "schedule_timeout=1s" in logs, logs
    finally:
        emu.admin("config", {"rbac": None}, "PUT")
        b.cleanup()


def test_unschedulable_process_says_why_without_a_traceback(k8s_env: dict[str, str], tmp_path: Path) -> None:
    # The log of a pod with no node is an empty 204 answer: "no logs yet", then the reason.
    script = tmp_path / "app.py"
    script.write_text(textwrap.dedent("""
        import fiber_core

        if __name__ == "__main__":
            p = fiber_core.Process(target=print, gpu=1)
            p.start()
            p.join(60)
            print("exitcode", p.exitcode, flush=True)
    """))
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                         env=script_env(k8s_env, FIBER_KUBERNETES_SCHEDULE_TIMEOUT="1"), timeout=2 * WAIT)
    assert out.returncode == 0, out.stderr
    assert "exitcode 1" in out.stdout, out.stderr
    assert "schedule_timeout=1s" in out.stderr and "Insufficient nvidia.com/gpu" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr


def test_lost_api_server_fails_polls_instead_of_hanging(k8s_env: dict[str, str], tmp_path: Path) -> None:
    proc, kubeconfig = start_emulator(tmp_path, "--instance", "lost-" + uuid.uuid4().hex[:6])
    try:
        b = KubernetesBackend(settings(kubeconfig=str(kubeconfig), namespace="default", api_timeout=0.5,
                                       node_selector=["nowhere=1"], schedule_timeout=0.0), "lost")
        job = b.start_job(job_spec("pass"))  # never scheduled: it waits as long as the API answers
        assert b.wait_for_job(job, 0.5) is None
    finally:
        proc.terminate()
        proc.wait(30)
    with pytest.raises(BackendError, match="lost the watch on the pods of run lost"):
        b.wait_for_job(job, WAIT)
    with pytest.raises(BackendError, match="cannot reach the Kubernetes API server"):
        b.terminate_job(job)
    b.cleanup()  # stops the watch's reconnection attempts (and warns that it cannot delete)


def test_no_kubeconfig_and_not_in_a_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            k8s_env: dict[str, str]) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    b = KubernetesBackend(settings(kubeconfig=None), "r1")
    with pytest.raises(BackendError) as e:
        b.start_job(job_spec("pass"))
    msg = str(e.value)
    assert "no Kubernetes cluster configured" in msg and "KUBERNETES_SERVICE_HOST is not set" in msg
    assert str(tmp_path / "missing") in msg and "FIBER_KUBERNETES_KUBECONFIG" in msg


def test_no_cluster_is_reported_before_the_listen_address(tmp_path: Path) -> None:
    """Outside a pod, with no kubeconfig and no listen_host, the error is the missing cluster (an
    address would not help), in a traceback that starts at the program's own frame."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FIBER_", "KUBE")) and k != "KUBERNETES_SERVICE_HOST"}
    env.update(FIBER_BACKEND="kubernetes", HOME=str(tmp_path), KUBECONFIG=str(tmp_path / "missing"))
    line, _ = failing_program(tmp_path, env, timeout=WAIT)
    assert line.startswith("fiber_core.base.errors.BackendError: no Kubernetes cluster configured: this "
                           "process is not in a pod"), line
    assert str(tmp_path / "missing") in line and "KUBECONFIG" in line
    assert "listen_host" not in line and "LISTEN_HOST" not in line
    # The same backend asked directly: the cluster first, here too.
    b = KubernetesBackend({"kubeconfig": str(tmp_path / "missing")}, "r1")
    with pytest.raises(BackendError, match="no Kubernetes cluster configured"):
        b.get_listen_addr()


def test_unreachable_api_server_reads_at_a_glance(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port of this machine where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "gone",
        "clusters": [{"name": "gone", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "gone", "context": {"cluster": "gone", "user": "u"}}]}))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FIBER_", "KUBE")) and k != "KUBERNETES_SERVICE_HOST"}
    env.update(FIBER_BACKEND="kubernetes", KUBECONFIG=str(kubeconfig), FIBER_LISTEN_HOST="127.0.0.1",
               FIBER_KUBERNETES_IMAGE="unused", FIBER_KUBERNETES_API_TIMEOUT="5")
    line, _ = failing_program(tmp_path, env, timeout=WAIT)
    assert line.startswith(f"fiber_core.base.errors.BackendError: cannot reach the Kubernetes API server at "
                           f"http://127.0.0.1:{port} (from kubeconfig {kubeconfig})"), line
    assert line.index("Check that the cluster is up") < line.index("(cause: urllib3.exceptions."), line


def test_listen_address_outside_a_cluster_must_be_configured(k8s_env: dict[str, str], tmp_path: Path) -> None:
    env = script_env(k8s_env)
    del env["FIBER_LISTEN_HOST"]
    code = textwrap.dedent("""
        import fiber_core
        p = fiber_core.Process(target=print)
        try:
            p.start()
        except fiber_core.ProcessError as e:
            print(type(e).__name__, e)
    """)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=WAIT)
    assert out.stdout.startswith("BackendError"), out.stdout + out.stderr
    assert "FIBER_LISTEN_HOST" in out.stdout and "fiber run" in out.stdout


# -- RBAC -----------------------------------------------------------------------------------------


def role_rules() -> dict[str, list[str]]:
    """The Role of rbac.yaml as the emulator's RBAC config ({resource: verbs})."""
    docs = list(yaml.safe_load_all(rbac.render("ns1")))
    assert [d["kind"] for d in docs] == ["ServiceAccount", "Role", "RoleBinding"]
    role = docs[1]
    rules: dict[str, list[str]] = {}
    for rule in role["rules"]:
        assert rule["apiGroups"] == [""]
        for resource in rule["resources"]:
            rules[resource] = rule["verbs"]
    assert all(d["metadata"]["namespace"] == "ns1" for d in docs)
    assert docs[2]["subjects"] == [{"kind": "ServiceAccount", "name": "fiber", "namespace": "ns1"}]
    return rules


def test_rbac_manifest_is_namespaced_least_privilege() -> None:
    assert role_rules() == {"pods": ["create", "get", "list", "watch", "delete", "deletecollection"],
                            "pods/log": ["get"], "secrets": ["create", "delete"]}
    assert subprocess.run([sys.executable, "-m", "fiber_k8s.rbac", "-n", "x"], capture_output=True,
                          text=True, timeout=WAIT).stdout == rbac.render("x")


def test_rbac_manifest_is_enough(emu: Emu, v1: client.CoreV1Api, ns: str, k8s_env: dict[str, str],
                                 image: str, restore_config: None) -> None:
    emu.admin("config", {"rbac": role_rules()}, "PUT")
    b = KubernetesBackend(settings(), "t" + uuid.uuid4().hex[:10])
    job = b.start_job(job_spec("import time; print('up', flush=True); time.sleep(60)"))
    done = b.start_job(job_spec("print('done')"))
    assert b.wait_for_job(done, WAIT) == 0 and "done" in b.get_job_logs(done)
    b.terminate_job(job)
    assert b.wait_for_job(job, WAIT) == -signal.SIGTERM
    b.cleanup()
    wait_pods(v1, ns, f"fiber.run={b.run_id}", lambda pods: not pods, "deleted")


@pytest.mark.parametrize("resource, verb", [("pods", "create"), ("pods", "list"), ("pods", "watch")])
def test_forbidden_names_the_missing_verb(emu: Emu, k8s_env: dict[str, str], restore_config: None,
                                          resource: str, verb: str) -> None:
    rules = role_rules()
    rules[resource] = [v for v in rules[resource] if v != verb]
    emu.admin("config", {"rbac": rules}, "PUT")
    b = KubernetesBackend(settings(), "t" + uuid.uuid4().hex[:10])
    try:
        with pytest.raises(BackendError) as e:
            b.start_job(job_spec("pass"))
        assert f"lacks the '{verb}' verb on '{resource}'" in str(e.value)
        assert "rbac.yaml" in str(e.value) and "forbidden" in str(e.value)
    finally:
        b.cleanup()


def test_without_log_or_deletecollection_permission(emu: Emu, v1: client.CoreV1Api, ns: str, k8s_env: dict[str, str],
                                                    image: str, restore_config: None) -> None:
    rules = role_rules()
    rules["pods"].remove("deletecollection")
    del rules["pods/log"]
    emu.admin("config", {"rbac": rules}, "PUT")
    b = KubernetesBackend(settings(), "t" + uuid.uuid4().hex[:10])
    job = b.start_job(job_spec("print('hi')"))
    assert b.wait_for_job(job, WAIT) == 0
    assert "lacks the 'get' verb on 'pods/log'" in b.get_job_logs(job)
    b.cleanup()  # falls back to one delete per pod
    wait_pods(v1, ns, f"fiber.run={b.run_id}", lambda pods: not pods, "deleted")


# -- processes and pools of pods ------------------------------------------------------------------


def test_pool_of_pods(v1: client.CoreV1Api, ns: str, k8s_env: dict[str, str], image: str) -> None:
    with fiber_core.Pool(3, backend="kubernetes") as pool:
        assert pool.map(pod_functions.square, range(50)) == [x * x for x in range(50)]
        where = pool.apply(pod_functions.pod_name)
        workers = {p.metadata.name for p in run_pods(v1, ns, f"fiber.run={runtime().run_id}")
                   if p.metadata.name.startswith("poolworker-")}
        assert len(workers) == 3  # one pod per worker (the pool does not wait for all to run)
        assert where in workers  # a task ran in one of the pool's pods


@pytest.mark.timeout(300)
def test_an_elastic_pool_takes_workers_as_the_cluster_grants_them(
        emu: Emu, v1: client.CoreV1Api, ns: str, k8s_env: dict[str, str], image: str,
        restore_config: None) -> None:
    """Room for two 1-CPU workers: the pool asks for four while work waits, finishes its map
    with what it got while two pods stay Pending (requests, not failures), and uses them
    once a node is added."""
    small = {"name": "small", "allocatable": {"cpu": "2"}}
    emu.admin("config", {"nodes": [small]}, "PUT")
    selector = f"fiber.run={runtime().run_id}"
    with fiber_core.Pool(4, min_processes=1, backend="kubernetes", cpu=1) as pool:
        assert pool.map(pod_functions.square, range(300)) == [x * x for x in range(300)]

        def settled(pods: list[client.V1Pod]) -> bool:
            # A pod the cluster has room for is Pending too until its container runs: wait
            # until two run and two are refused a node.
            workers = [p for p in pods if p.metadata.name.startswith("poolworker-")]
            return (len(workers) == 4 and sum(p.status.phase == "Running" for p in workers) == 2
                    and sum(unschedulable(p) for p in workers) == 2)

        pods = wait_pods(v1, ns, selector, settled, "two worker pods running, two with no room")
        phases = sorted(p.status.phase for p in pods if p.metadata.name.startswith("poolworker-"))
        assert phases == ["Pending", "Pending", "Running", "Running"]  # asked for, not failed
        emu.admin("config", {"nodes": [small, {"name": "added", "allocatable": {"cpu": "2"}}]}, "PUT")
        barrier = fiber_core.Barrier(4)
        names = pool.map(functools.partial(pod_functions.meet, barrier=barrier), range(4), chunksize=1)
        assert len(set(names)) == 4
        assert {p.spec.node_name for p in run_pods(v1, ns, selector)
                if p.metadata.name in names} == {"small", "added"}


def test_a_gang_ring_that_the_cluster_cannot_hold_whole_runs_no_member(
        emu: Emu, v1: client.CoreV1Api, ns: str, k8s_env: dict[str, str], image: str,
        restore_config: None) -> None:
    """Room for two of three 1-CPU members: two pods run and one stays Pending; with
    gang=True none runs its function, and the ring is stopped whole after gang_timeout."""
    from fiber_core.parallel.ring import RingError

    emu.admin("config", {"nodes": [{"name": "small", "allocatable": {"cpu": "2"}}]}, "PUT")
    out = fiber_core.Queue()
    ring = fiber_core.Ring(3, functools.partial(pod_functions.put_rank, out), backend="kubernetes",
                           cpu=1, gang=True, gang_timeout=5)
    with pytest.raises(RingError, match=r"only 2 of 3 ring members were running after gang_timeout=5 s"):
        ring.start()
    assert out.empty()
    wait_pods(v1, ns, f"fiber.run={runtime().run_id}", lambda pods: all(
        p.metadata.deletion_timestamp or p.status.phase in ("Succeeded", "Failed")
        for p in pods if p.metadata.name.startswith("ring-")), "the ring's pods stopped")


@pytest.mark.timeout(600)
def test_pool_map_under_evictions_charges_no_task(v1: client.CoreV1Api, ns: str, k8s_env: dict[str, str],
                                                  image: str) -> None:
    """Worker pods evicted through the Eviction API (DisruptionTarget, then a graceful delete:
    SIGTERM, SIGKILL after the grace period) every 1-2 s during a map: every result exactly
    once and in order, and no task charged (``task_losses=1``: one charged death fails it)."""
    import random

    n = 6000
    rng = random.Random(5)
    stop = threading.Event()
    evicted: list[fiber_core.Process] = []

    def evict(pool: fiber_core.Pool) -> None:
        while not stop.wait(rng.uniform(1.0, 2.0)):
            with pool._lock:
                running = [w.process for w in pool._workers.values()
                           if w.ready and not w.lost and not w.draining and w.process.job is not None]
            if not running:
                continue
            victim = rng.choice(running)
            try:
                v1.create_namespaced_pod_eviction(victim.job.id, ns, client.V1Eviction(
                    metadata=client.V1ObjectMeta(name=victim.job.id),
                    delete_options=client.V1DeleteOptions(grace_period_seconds=2)))
                evicted.append(victim)
            except client.ApiException:
                pass  # it ended meanwhile

    with fiber_core.Pool(4, backend="kubernetes", task_losses=1) as pool:
        thread = threading.Thread(target=evict, args=(pool,), daemon=True)
        thread.start()
        try:
            out = pool.map(pod_functions.ms_task, range(n), chunksize=5)
        finally:
            stop.set()
            thread.join(WAIT)
        assert out == list(range(n))
        assert pool.map(pod_functions.square, range(8)) == [x * x for x in range(8)]
        assert evicted, "no worker pod was evicted during the map"
        for p in evicted:  # before the pool's end stops the workers: the last eviction may be under way
            p.join(WAIT)
            assert p.job is not None and p.job.state.reason is EndReason.PREEMPTED, p.job.state


@pytest.mark.timeout(300)
def test_a_pool_rides_out_an_api_server_that_goes_away_and_comes_back(
        v1: client.CoreV1Api, ns: str, k8s_env: dict[str, str], image: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The API server restarts mid-map (as a client sees it: every connection, the pod watch
    included, reset; new ones refused for 5 s; then the same state on the same address), and
    a worker pod is evicted while it is away. The pods keep running, the map finishes with
    every result once and in order, and the watch that resumes sees the eviction."""
    from urllib.parse import urlsplit

    from fiber_core.testing.outage import Outage

    kubeconfig = yaml.safe_load(Path(k8s_env["FIBER_KUBERNETES_KUBECONFIG"]).read_text())
    cluster = kubeconfig["clusters"][0]["cluster"]
    target = urlsplit(cluster["server"])
    assert target.hostname is not None and target.port is not None
    with Outage(target.hostname, target.port) as api:
        cluster["server"] = f"{target.scheme}://127.0.0.1:{api.port}"
        through = tmp_path / "kubeconfig"
        through.write_text(yaml.safe_dump(kubeconfig))
        monkeypatch.setenv("FIBER_KUBERNETES_KUBECONFIG", str(through))  # a new backend: through it
        n = 600
        with fiber_core.Pool(3, backend="kubernetes") as pool:
            results = pool.imap(pod_functions.ms_task, range(n), chunksize=2)
            first = [next(results) for _ in range(100)]
            with pool._lock:
                victim = next(w.process for w in pool._workers.values()
                              if w.ready and not w.lost and w.process.job is not None)
            api.cut()
            before = api.accepted
            assert before > 0  # the backend talks through it
            assert victim.job is not None
            v1.create_namespaced_pod_eviction(victim.job.id, ns, client.V1Eviction(
                metadata=client.V1ObjectMeta(name=victim.job.id),
                delete_options=client.V1DeleteOptions(grace_period_seconds=1)))
            threading.Event().wait(5.0)  # the length of the outage, not a synchronisation
            api.restore()
            out = first + list(results)
            assert out == list(range(n))
            victim.join(WAIT)
            assert victim.job.state.reason is EndReason.PREEMPTED, victim.job.state
            assert pool.map(pod_functions.square, range(8)) == [x * x for x in range(8)]
        assert api.accepted > before  # it came back to the same address


def test_process_roundtrip_and_cleanup_after_normal_exit(v1: client.CoreV1Api, ns: str, k8s_env: dict[str, str],
                                                         image: str, tmp_path: Path) -> None:
    script = tmp_path / "app.py"
    script.write_text(textwrap.dedent("""
        import fiber_core
        from fiber_core.runtime.run import runtime

        def put(q, x):
            q.put(x + 1)

        if __name__ == "__main__":
            print("run", runtime().run_id, flush=True)
            q = fiber_core.Queue()
            ps = [fiber_core.Process(target=put, args=(q, i)) for i in range(2)]
            for p in ps:
                p.start()
            print("got", sorted(q.get(timeout=60) for _ in ps), flush=True)
            for p in ps:
                p.join(60)
            print("codes", [p.exitcode for p in ps], flush=True)
    """))
    out = subprocess.run([sys.executable, str(script)], env=script_env(k8s_env), cwd=tmp_path,
                         capture_output=True, text=True, timeout=2 * WAIT)
    assert out.returncode == 0, out.stdout + out.stderr
    run = re.search(r"run (\w+)", out.stdout).group(1)
    assert "got [1, 2]" in out.stdout and "codes [0, 0]" in out.stdout
    # The finished pods were deleted when the program exited.
    wait_pods(v1, ns, f"fiber.run={run}", lambda pods: not pods, "deleted")


def test_parent_killed_workers_exit_and_fiber_clean_removes_pods(
        v1: client.CoreV1Api, ns: str, k8s_env: dict[str, str], image: str, tmp_path: Path) -> None:
    script = tmp_path / "app.py"
    script.write_text(textwrap.dedent("""
        import time
        import fiber_core
        from fiber_core.runtime.run import runtime

        def forever(q):
            q.put("up")
            time.sleep(600)

        if __name__ == "__main__":
            q = fiber_core.Queue()
            p = fiber_core.Process(target=forever, args=(q,))
            p.start()
            assert q.get(timeout=60) == "up"
            print("run", runtime().run_id, flush=True)
            time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], env=script_env(k8s_env), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        timer = threading.Timer(2 * WAIT, proc.kill)  # bounds the read below
        timer.start()
        line = proc.stdout.readline()
        timer.cancel()
        assert line.startswith("run "), line + proc.stderr.read()
        run = line.split()[1]
        assert len(run_pods(v1, ns, f"fiber.run={run}")) == 1
        proc.send_signal(signal.SIGKILL)  # no cleanup can run
        proc.wait(WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(WAIT)
    # The worker lost its parent's connection and exited; its pod stays, finished.
    pods = wait_pods(v1, ns, f"fiber.run={run}",
                     lambda pods: bool(pods) and all(p.status.phase in ("Succeeded", "Failed") for p in pods),
                     "finished")
    assert len(pods) == 1
    out = subprocess.run([sys.executable, "-m", "fiber_core.cli", "clean", "--backend", "kubernetes", "--run", run],
                         env=script_env(k8s_env), cwd=tmp_path, capture_output=True, text=True, timeout=WAIT)
    assert out.returncode == 0, out.stderr
    assert f"removed pod {ns}/{pods[0].metadata.name}" in out.stdout
    wait_pods(v1, ns, f"fiber.run={run}", lambda pods: not pods, "deleted")


def test_status_comes_from_one_watch(backend: KubernetesBackend) -> None:
    jobs = [backend.start_job(job_spec("import time; time.sleep(60)")) for _ in range(3)]
    cluster = backend.cluster
    calls: list[tuple] = []
    real = cluster.request

    def counting(*args: Any, **kw: Any) -> Any:  # the real request, counted
        calls.append(args[:4])
        return real(*args, **kw)

    cluster.request = counting  # type: ignore[method-assign]
    for _ in range(100):
        assert all(backend.poll_job(j) is None for j in jobs)
    assert calls == []  # polls answer from the watch's state
    for j in jobs:
        backend.kill_job(j)
    assert [backend.wait_for_job(j, WAIT) for j in jobs] == [-signal.SIGKILL] * 3



# -- why a job ended --------------------------------------------------------------------------------


def running_job(backend: KubernetesBackend) -> Any:
    """A job whose container runs (and prints 'up') until it is stopped."""
    job = backend.start_job(job_spec("import time; print('up', flush=True); time.sleep(120)"))
    assert backend.wait_started(job, WAIT) is None, backend.get_job_logs(job)
    return job


def test_own_exit_is_exited(backend: KubernetesBackend) -> None:
    job = backend.start_job(job_spec("import sys; sys.exit(3)"))
    assert backend.wait_for_job(job, WAIT) == 3
    assert job.state.reason is EndReason.EXITED and job.state.detail == ""
    assert backend.end_reason(job) is EndReason.EXITED


def test_stopped_by_fiber(backend: KubernetesBackend) -> None:
    job = running_job(backend)
    backend.stop_job(job)  # what Process.terminate() calls
    assert backend.wait_for_job(job, WAIT) == -signal.SIGTERM
    assert job.state.reason is EndReason.STOPPED


def test_eviction_by_the_eviction_api_is_preempted(v1: client.CoreV1Api, ns: str, backend: KubernetesBackend) -> None:
    # What `kubectl drain` does: the API server marks the pod DisruptionTarget, then deletes it.
    job = running_job(backend)
    v1.create_namespaced_pod_eviction(job.id, ns, client.V1Eviction(metadata=client.V1ObjectMeta(name=job.id)))
    assert backend.wait_for_job(job, WAIT) == -signal.SIGTERM  # deleted gracefully: SIGTERM
    assert job.state.reason is EndReason.PREEMPTED
    assert "EvictionByEvictionAPI: Eviction API: evicting" in job.state.detail
    assert "EvictionByEvictionAPI" in backend.get_job_logs(job)


def test_node_pressure_eviction_is_preempted(emu: Emu, v1: client.CoreV1Api, ns: str,
                                             backend: KubernetesBackend) -> None:
    job = running_job(backend)
    emu.admin("evict", {"namespace": ns, "name": job.id, "resource": "memory"}, "POST")
    assert backend.wait_for_job(job, WAIT) == -signal.SIGKILL
    assert job.state.reason is EndReason.PREEMPTED
    assert "was evicted (TerminationByKubelet: The node was low on resource: memory.)" in job.state.detail
    pod = v1.read_namespaced_pod(job.id, ns)  # an evicted pod stays, Failed, until it is deleted
    assert pod.status.phase == "Failed" and pod.status.reason == "Evicted"
    assert [(c.reason, c.status) for c in pod.status.conditions if c.type == "DisruptionTarget"] == [
        ("TerminationByKubelet", "True")]


def test_deleted_by_someone_else_is_host_lost(v1: client.CoreV1Api, ns: str, backend: KubernetesBackend) -> None:
    job = running_job(backend)
    v1.delete_namespaced_pod(job.id, ns, grace_period_seconds=1)
    assert backend.wait_for_job(job, WAIT) == -signal.SIGTERM
    assert job.state.reason is EndReason.HOST_LOST and "someone other than Fiber" in job.state.detail


# -- exit with a kubeconfig that embeds its CA -----------------------------------------------------


@pytest.mark.parametrize("ending", ["normal", "exception", "sigterm"])
def test_no_pod_is_left_with_an_embedded_ca(tls_emu: Emu, k8s_env: dict[str, str], image: str,
                                            tmp_path: Path, ending: str) -> None:
    # The client writes certificate-authority-data to a temporary file that its own exit
    # handler deletes: Fiber's exit must have deleted the pods by then.
    assert "certificate-authority-data" in Path(tls_emu.kubeconfig).read_text()
    tls_v1 = client.CoreV1Api(tls_emu.api_client)
    script = tmp_path / "app.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        import fiber_core
        from fiber_core.runtime.run import runtime

        def forever(q):
            q.put("up")
            time.sleep(600)

        if __name__ == "__main__":
            q = fiber_core.Queue()
            p = fiber_core.Process(target=forever, args=(q,), daemon=True)
            p.start()
            assert q.get(timeout=60) == "up"
            print("run", runtime().run_id, flush=True)
            if sys.argv[1] == "exception":
                raise RuntimeError("the program failed")
            if sys.argv[1] == "sigterm":
                time.sleep(600)
    """))
    tmp = tmp_path / "tmp"  # where the client writes the CA, and Fiber its run directory
    tmp.mkdir()
    env = script_env(k8s_env, FIBER_KUBERNETES_KUBECONFIG=tls_emu.kubeconfig, FIBER_KUBERNETES_NAMESPACE="default",
                     TMPDIR=str(tmp))
    proc = subprocess.Popen([sys.executable, str(script), ending], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        timer = threading.Timer(2 * WAIT, proc.kill)  # bounds the read below
        timer.start()
        line = proc.stdout.readline()
        timer.cancel()
        assert line.startswith("run "), line + proc.stderr.read()
        run = line.split()[1]
        assert len(run_pods(tls_v1, "default", f"fiber.run={run}")) == 1
        if ending == "sigterm":
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=2 * WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(WAIT)
    expected = {"normal": 0, "exception": 1, "sigterm": -signal.SIGTERM}[ending]
    assert proc.returncode == expected, err
    assert "SSLError" not in err and "could not delete" not in err, err
    assert ("the program failed" in err) == (ending == "exception"), err
    wait_pods(tls_v1, "default", f"fiber.run={run}", lambda pods: not pods, "deleted")
    assert list(tmp.iterdir()) == []  # the exit handlers after Fiber's ran too


# -- the run's key ---------------------------------------------------------------------------------


def test_the_runs_key_is_in_a_secret_not_in_the_pods(v1: client.CoreV1Api, ns: str, k8s_env: dict[str, str],
                                                     image: str) -> None:
    key = runtime().authkey.hex()
    q = fiber_core.Queue()
    p = fiber_core.Process(target=pod_functions.put_square, args=(q, 7), backend="kubernetes")
    p.start()
    assert q.get(timeout=WAIT) == 49  # the job authenticated with the key it took from the Secret
    p.join(WAIT)
    pods = run_pods(v1, ns, f"fiber.run={runtime().run_id}")
    assert pods
    listed = json.dumps(v1.api_client.sanitize_for_serialization(pods))
    assert key not in listed and base64.b64encode(key.encode()).decode() not in listed
    refs = {e.value_from.secret_key_ref.name for pod in pods for e in pod.spec.containers[0].env
            if e.name == "FIBER_AUTHKEY"}
    assert len(refs) == 1
    secret = v1.read_namespaced_secret(refs.pop(), ns)
    assert base64.b64decode(secret.data["authkey"]).decode() == key
    assert secret.metadata.labels["fiber.run"] == label_value(runtime().run_id)
    runtime().get_backend("kubernetes").cleanup()
    with pytest.raises(client.ApiException) as e:
        v1.read_namespaced_secret(secret.metadata.name, ns)
    assert e.value.status == 404


def test_fiber_clean_removes_the_secret_a_crashed_parent_left(v1: client.CoreV1Api, ns: str,
                                                             k8s_env: dict[str, str]) -> None:
    # A parent outside the cluster has no pod to own its Secret: `fiber clean` finds the
    # Secret through the pods that refer to it.
    b = KubernetesBackend(settings(node_selector=["nowhere=1"], schedule_timeout=0.0), "t" + uuid.uuid4().hex[:10])
    try:
        b.start_job(job_spec("pass", env={"FIBER_AUTHKEY": "ab" * 32}))
        (pod,) = run_pods(v1, ns, f"fiber.run={b.run_id}")
        (ref,) = [e.value_from.secret_key_ref for e in pod.spec.containers[0].env if e.name == "FIBER_AUTHKEY"]
        assert ref.key == "authkey"
        assert v1.read_namespaced_secret(ref.name, ns).metadata.owner_references is None
        removed = KubernetesBackend.clean(settings(), b.run_id)
        assert sorted(removed) == [f"pod {ns}/{pod.metadata.name}", f"secret {ns}/{ref.name}"]
        with pytest.raises(client.ApiException) as e:
            v1.read_namespaced_secret(ref.name, ns)
        assert e.value.status == 404
    finally:
        b.cleanup()


# -- a user's pod template ------------------------------------------------------------------------


def test_pod_template_reaches_the_pods_of_a_run(v1: client.CoreV1Api, ns: str, k8s_env: dict[str, str],
                                                image: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # The emulator has no PriorityClass objects and one node: those fields are left out here.
    path = tmp_path / "pod.yaml"
    path.write_text(textwrap.dedent("""\
        metadata:
          labels: {kueue.x-k8s.io/queue-name: team-a}
          annotations: {example.com/owner: es-team}
        spec:
          tolerations: [{key: spot, operator: Exists, effect: NoSchedule}]
          containers: [{name: job, env: [{name: FROM_TEMPLATE, value: seen}]}]
    """))
    monkeypatch.setenv("FIBER_KUBERNETES_POD_TEMPLATE", str(path))
    config.reset()
    q = fiber_core.Queue()
    p = fiber_core.Process(target=pod_functions.put_env, args=(q, "FROM_TEMPLATE"), backend="kubernetes")
    p.start()
    assert q.get(timeout=WAIT) == "seen"  # the template's env reached the job
    p.join(WAIT)
    assert p.exitcode == 0
    pod = v1.read_namespaced_pod(p.job.id, ns)
    assert pod.metadata.labels["kueue.x-k8s.io/queue-name"] == "team-a"
    assert pod.metadata.labels["fiber.run"] == label_value(runtime().run_id)
    assert pod.metadata.annotations["example.com/owner"] == "es-team"
    assert ("spot", "Exists", "NoSchedule") in [(t.key, t.operator, t.effect) for t in pod.spec.tolerations]


# -- group starts ---------------------------------------------------------------------------------


def test_start_jobs_creates_pods_concurrently_all_or_nothing(v1: client.CoreV1Api, ns: str,
                                                             backend: KubernetesBackend) -> None:
    jobs = backend.start_jobs([job_spec(f"print({i})", name=f"g{i}") for i in range(6)])
    assert [j.spec.name for j in jobs] == [f"g{i}" for i in range(6)]  # in the order of the specs
    names = ",".join(f"g{i}" for i in range(6))
    assert len(run_pods(v1, ns, f"{backend.selector},fiber.name in ({names})")) == 6
    for i, job in enumerate(jobs):
        assert backend.wait_for_job(job, WAIT) == 0
        assert backend.get_job_logs(job).strip() == str(i)
    # One spec the API server refuses (a node selector key it rejects): no pod of the call stays.
    specs = [job_spec("import time; time.sleep(60)", name=f"h{i}") for i in range(5)]
    specs.append(job_spec("pass", name="bad", backend_options={"node_selector": ["bad key!=x"]}))
    with pytest.raises(BackendError, match="nodeSelector"):
        backend.start_jobs(specs)
    wait_pods(v1, ns, backend.selector + ",fiber.name in (h0,h1,h2,h3,h4,bad)", lambda pods: not pods,
              "the pods of the refused call deleted")
