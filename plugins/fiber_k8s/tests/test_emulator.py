"""The Kubernetes API emulator, driven through the official `kubernetes` client.

Its fixtures (the emulator, a namespace, the image) are in conftest.py.
"""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Callable
from typing import Any

import pytest

k8s = pytest.importorskip("kubernetes")
from k8s_helpers import IMAGE, WAIT, Emu, unschedulable  # noqa: E402
from kubernetes import client, watch  # noqa: E402
from kubernetes.client.rest import ApiException  # noqa: E402

USER = "system:serviceaccount:default:fiber"


def pod(name: str = "", image: str = IMAGE, command: list[str] | None = None, labels: dict[str, str] | None = None,
        **spec: Any) -> client.V1Pod:
    container = client.V1Container(name="main", image=image, command=command or ["sleep", "300"],
                                   **spec.pop("container", {}))
    meta = client.V1ObjectMeta(name=name or None, generate_name=None if name else "emu-", labels=labels)
    return client.V1Pod(metadata=meta, spec=client.V1PodSpec(restart_policy=spec.pop("restart_policy", "Never"),
                                                             containers=[container], **spec))


def wait_pod(v1: client.CoreV1Api, ns: str, name: str, until: Callable[[str, client.V1Pod], bool],
             since: str | None = None, timeout: float = WAIT) -> tuple[str, client.V1Pod]:
    """Watch one pod (from resourceVersion `since`, else from its current state) until
    `until(event_type, pod)` holds; fails after `timeout` seconds."""
    last: Any = None
    w = watch.Watch()
    kw = {"resource_version": since} if since else {}
    for ev in w.stream(v1.list_namespaced_pod, ns, field_selector=f"metadata.name={name}",
                       timeout_seconds=int(timeout), _request_timeout=timeout + 5, **kw):
        last = (ev["type"], ev["object"])
        if until(*last):
            w.stop()
            return last
    raise AssertionError(f"pod {name} did not get there in {timeout} s; last event: {last}")


def error(e: ApiException) -> dict[str, Any]:
    return json.loads(e.body)


def waiting_reason(p: client.V1Pod) -> str | None:
    cs = p.status.container_statuses
    return cs[0].state.waiting.reason if cs and cs[0].state.waiting else None


def container_names(emu: Emu) -> set[str]:
    return {c["pod"] for c in emu.admin("state")["containers"]}


# --- discovery and namespaces ---------------------------------------------------------------------


def test_discovery_and_namespaces(emu: Emu, v1: client.CoreV1Api) -> None:
    assert client.VersionApi(emu.api_client).get_code().major == "1"
    assert "v1" in client.CoreApi(emu.api_client).get_api_versions().versions
    names = {r.name for r in v1.get_api_resources().resources}
    assert {"pods", "pods/eviction", "pods/log", "namespaces", "nodes"} <= names
    assert v1.read_namespace("default").status.phase == "Active"
    with pytest.raises(ApiException) as e:
        v1.read_namespace("no-such-ns")
    assert e.value.status == 404
    assert error(e.value)["reason"] == "NotFound"
    assert error(e.value)["message"] == 'namespaces "no-such-ns" not found'
    with pytest.raises(ApiException) as e:
        v1.create_namespaced_pod("no-such-ns", pod("x"))
    assert e.value.status == 404
    nodes = v1.list_node().items
    assert nodes and nodes[0].status.allocatable["cpu"]


def test_wrong_token_is_401(emu: Emu) -> None:
    conf = client.Configuration(host=emu.url, api_key={"authorization": "Bearer wrong"})
    with pytest.raises(ApiException) as e:
        client.CoreV1Api(client.ApiClient(conf)).list_namespaced_pod("default")
    assert e.value.status == 401 and error(e.value)["reason"] == "Unauthorized"


# --- pods through the API (no container needs to run) ---------------------------------------------


def test_create_get_list_select_delete(v1: client.CoreV1Api, ns: str) -> None:
    unschedulable = {"node_selector": {"emulator-test": "nowhere"}}  # stays Pending without docker
    a = v1.create_namespaced_pod(ns, pod(labels={"app": "sel", "tier": "a"}, **unschedulable))
    b = v1.create_namespaced_pod(ns, pod(labels={"app": "sel", "tier": "b"}, **unschedulable))
    assert a.metadata.name.startswith("emu-") and len(a.metadata.name) == 9
    assert a.metadata.uid and a.metadata.namespace == ns and a.status.phase == "Pending"
    assert a.spec.restart_policy == "Never" and a.spec.service_account_name == "default"
    assert int(b.metadata.resource_version) > int(a.metadata.resource_version)
    got = v1.read_namespaced_pod(a.metadata.name, ns)
    assert got.metadata.uid == a.metadata.uid

    def names(**kw: str) -> set[str]:
        return {p.metadata.name for p in v1.list_namespaced_pod(ns, **kw).items}
    both = {a.metadata.name, b.metadata.name}
    assert names(label_selector="app=sel") == both
    assert names(label_selector="app==sel,tier!=a") == {b.metadata.name}
    assert names(label_selector="tier in (a, c)") == {a.metadata.name}
    assert names(label_selector="app=sel,tier notin (a)") == {b.metadata.name}
    assert names(label_selector="tier,!nothing,app=sel") == both
    assert names(label_selector="!tier") & both == set()
    assert names(field_selector=f"metadata.name={a.metadata.name}") == {a.metadata.name}
    with pytest.raises(ApiException) as e:
        v1.list_namespaced_pod(ns, field_selector="spec.bogus=1")
    assert e.value.status == 400

    deleted = v1.delete_namespaced_pod(a.metadata.name, ns)
    assert deleted.metadata.uid == a.metadata.uid
    with pytest.raises(ApiException) as e:
        v1.read_namespaced_pod(a.metadata.name, ns)
    assert e.value.status == 404 and error(e.value)["message"] == f'pods "{a.metadata.name}" not found'
    v1.delete_collection_namespaced_pod(ns, label_selector="app=sel")
    assert names(label_selector="app=sel") == set()


def test_duplicate_name_is_409(v1: client.CoreV1Api, ns: str) -> None:
    v1.create_namespaced_pod(ns, pod("dup", node_selector={"emulator-test": "nowhere"}))
    with pytest.raises(ApiException) as e:
        v1.create_namespaced_pod(ns, pod("dup"))
    assert e.value.status == 409
    assert error(e.value)["reason"] == "AlreadyExists"
    assert error(e.value)["message"] == 'pods "dup" already exists'
    v1.delete_namespaced_pod("dup", ns, grace_period_seconds=0)


SUBDOMAIN = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters"


@pytest.mark.parametrize("body, field, text", [
    (pod("Bad_Name"), "metadata.name", f'Invalid value: "Bad_Name": {SUBDOMAIN}'),
    (pod("a" * 254), "metadata.name", "must be no more than 253 characters"),
    (pod("ok", labels={"bad key!": "v"}), "metadata.labels", 'Invalid value: "bad key!": name part must consist'),
    (pod("ok", labels={"k": "v" * 64}), "metadata.labels", "must be no more than 63 characters"),
    (pod("ok", labels={"k": "-v"}), "metadata.labels", 'Invalid value: "-v": a valid label must be an empty string'),
    (pod("ok", image=""), "spec.containers[0].image", "Required value"),
    (client.V1Pod(metadata=client.V1ObjectMeta(name="ok"), spec=client.V1PodSpec(containers=[])),
     "spec.containers", "Required value"),
    (pod("ok", container={"resources": client.V1ResourceRequirements(requests={"nvidia.com/gpu": "1"})}),
     "spec.containers[0].resources.limits", "Limit must be set for non overcommitable resources"),
    (pod("ok", restart_policy="Always"), "spec.restartPolicy", 'Unsupported value: "Always"'),
])
def test_validation_is_422(v1: client.CoreV1Api, ns: str, body: client.V1Pod, field: str, text: str) -> None:
    with pytest.raises(ApiException) as e:
        v1.create_namespaced_pod(ns, body)
    status = error(e.value)
    assert e.value.status == 422 and status["reason"] == "Invalid" and status["kind"] == "Status"
    assert status["message"].startswith(f'Pod "{body.metadata.name}" is invalid: ')
    assert f"{field}: " in status["message"] and text in status["message"]
    assert field in {c["field"] for c in status["details"]["causes"]}


def test_bad_quantity_is_400(v1: client.CoreV1Api, ns: str) -> None:
    limits = client.V1ResourceRequirements(limits={"cpu": "lots"})
    with pytest.raises(ApiException) as e:
        v1.create_namespaced_pod(ns, pod("ok", container={"resources": limits}))
    assert e.value.status == 400 and "quantities must match" in error(e.value)["message"]


def test_accepts_the_fields_a_backend_uses(v1: client.CoreV1Api, ns: str) -> None:
    owner = client.V1OwnerReference(api_version="v1", kind="Pod", name="parent", uid=str(uuid.uuid4()))
    body = pod("full", labels={"fiber.io/run": "r1"}, node_selector={"emulator-test": "nowhere"},
               tolerations=[client.V1Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")],
               service_account_name="fiber", image_pull_secrets=[client.V1LocalObjectReference(name="regcred")],
               host_network=True,
               volumes=[client.V1Volume(name="data", persistent_volume_claim=client.V1PersistentVolumeClaimVolumeSource(
                   claim_name="pvc-1"))],
               container={"env": [client.V1EnvVar(name="FOO", value="bar")], "working_dir": "/tmp",
                          "volume_mounts": [client.V1VolumeMount(name="data", mount_path="/data")],
                          "resources": client.V1ResourceRequirements(
                              requests={"cpu": "500m", "memory": "128Mi"},
                              limits={"cpu": "1", "memory": "256Mi", "nvidia.com/gpu": "1"})})
    body.metadata.owner_references = [owner]
    created = v1.create_namespaced_pod(ns, body)
    assert created.metadata.owner_references[0].uid == owner.uid
    res = created.spec.containers[0].resources
    assert res.requests["nvidia.com/gpu"] == "1"  # defaulted from the limit, as the API server does
    assert created.status.qos_class == "Burstable"
    v1.delete_namespaced_pod("full", ns, grace_period_seconds=0)


def test_watch_events_resume_and_timeout(v1: client.CoreV1Api, ns: str) -> None:
    labels, nowhere = {"app": "watch"}, {"emulator-test": "nowhere"}
    first = v1.create_namespaced_pod(ns, pod(labels=labels, node_selector=nowhere))
    wait_pod(v1, ns, first.metadata.name, lambda _, p: bool(p.status.conditions))  # the scheduler is done
    since = v1.list_namespaced_pod(ns, label_selector="app=watch").metadata.resource_version
    second = v1.create_namespaced_pod(ns, pod(labels=labels, node_selector=nowhere))
    v1.delete_namespaced_pod(second.metadata.name, ns)
    events = [(ev["type"], ev["object"].metadata.name, int(ev["object"].metadata.resource_version))
              for ev in watch.Watch().stream(v1.list_namespaced_pod, ns, label_selector="app=watch",
                                             resource_version=since, timeout_seconds=2, _request_timeout=10)]
    # Resumed after `first`: only the later events, in resourceVersion order; the stream ends by timeout.
    kinds = [(k, n) for k, n, _ in events]
    assert kinds[0] == ("ADDED", second.metadata.name) and ("DELETED", second.metadata.name) in kinds
    assert first.metadata.name not in {n for _, n, _ in events}
    rvs = [rv for _, _, rv in events]
    assert rvs == sorted(rvs) and rvs[0] > int(since)
    # Without resourceVersion a watch starts with the current objects as ADDED.
    added = [ev["object"].metadata.name for ev in watch.Watch().stream(
        v1.list_namespaced_pod, ns, label_selector="app=watch", timeout_seconds=1, _request_timeout=10)]
    assert added == [first.metadata.name]
    v1.delete_collection_namespaced_pod(ns, label_selector="app=watch", grace_period_seconds=0)


# --- RBAC -----------------------------------------------------------------------------------------


def test_rbac_forbidden_messages(emu: Emu, v1: client.CoreV1Api, restore_config: None) -> None:
    emu.admin("config", {"rbac": {"pods": ["get", "list", "watch", "delete"]}}, "PUT")
    with pytest.raises(ApiException) as e:
        v1.create_namespaced_pod("default", pod("x"))
    assert e.value.status == 403 and error(e.value)["reason"] == "Forbidden"
    assert error(e.value)["message"] == (f'pods is forbidden: User "{USER}" cannot create resource "pods" '
                                         'in API group "" in the namespace "default"')
    with pytest.raises(ApiException) as e:
        v1.read_namespaced_pod_log("x", "default")
    assert error(e.value)["message"] == (f'pods "x" is forbidden: User "{USER}" cannot get resource "pods/log" '
                                         'in API group "" in the namespace "default"')
    v1.list_namespaced_pod("default")  # allowed verbs still work
    emu.admin("config", {"rbac": {"pods": ["create", "get", "list", "watch", "delete"], "pods/log": ["get"]}}, "PUT")
    with pytest.raises(ApiException) as e:
        v1.delete_collection_namespaced_pod("default", label_selector="none=1")
    assert e.value.status == 403 and "cannot deletecollection resource" in error(e.value)["message"]


# --- scheduling -----------------------------------------------------------------------------------


def test_gpu_pod_is_unschedulable_until_a_gpu_node_exists(emu: Emu, v1: client.CoreV1Api, ns: str,
                                                          restore_config: None) -> None:
    gpu = client.V1ResourceRequirements(limits={"nvidia.com/gpu": "1"})
    created = v1.create_namespaced_pod(ns, pod(command=["true"], container={"resources": gpu}))
    name = created.metadata.name
    _, p = wait_pod(v1, ns, name, lambda _, p: unschedulable(p))
    cond = next(c for c in p.status.conditions if c.type == "PodScheduled")
    assert p.status.phase == "Pending" and cond.reason == "Unschedulable"
    assert cond.message.startswith("0/1 nodes are available: 1 Insufficient nvidia.com/gpu.")
    nodes = emu.admin("config")["nodes"]
    emu.admin("config", {"nodes": nodes + [{"name": "gpu-node", "labels": {"accelerator": "a100"},
                                            "allocatable": {"nvidia.com/gpu": 2}}]}, "PUT")
    _, p = wait_pod(v1, ns, name, lambda _, p: bool(p.spec.node_name))
    assert p.spec.node_name == "gpu-node"
    v1.delete_namespaced_pod(name, ns, grace_period_seconds=0)


def test_node_selector_mismatch_message(v1: client.CoreV1Api, ns: str) -> None:
    created = v1.create_namespaced_pod(ns, pod(node_selector={"emulator-test": "nowhere"}))
    _, p = wait_pod(v1, ns, created.metadata.name, lambda _, p: bool(p.status.conditions))
    assert p.status.conditions[0].message.startswith(
        "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector.")
    v1.delete_namespaced_pod(created.metadata.name, ns, grace_period_seconds=0)


def test_log_of_a_pod_with_no_node_is_204_and_empty(v1: client.CoreV1Api, ns: str) -> None:
    # As kube-apiserver: no node, no log location: 204 No Content, no body (not an error).
    created = v1.create_namespaced_pod(ns, pod(node_selector={"emulator-test": "nowhere"}))
    name = created.metadata.name
    wait_pod(v1, ns, name, lambda _, p: bool(p.status.conditions))
    resp = v1.read_namespaced_pod_log(name, ns, _preload_content=False)
    assert (resp.status, resp.data) == (204, b"")
    v1.delete_namespaced_pod(name, ns, grace_period_seconds=0)


# --- the test kubelet (docker) --------------------------------------------------------------------


def test_missing_image_is_err_image_pull_then_backoff(v1: client.CoreV1Api, ns: str, image: str) -> None:
    name = v1.create_namespaced_pod(ns, pod(image="fiber-no-such-image:1")).metadata.name
    _, p = wait_pod(v1, ns, name, lambda _, p: waiting_reason(p) == "ErrImagePull")
    assert p.status.phase == "Pending"
    assert "fiber-no-such-image:1" in p.status.container_statuses[0].state.waiting.message
    _, p = wait_pod(v1, ns, name, lambda _, p: waiting_reason(p) == "ImagePullBackOff")
    assert p.status.container_statuses[0].state.waiting.message == 'Back-off pulling image "fiber-no-such-image:1"'
    with pytest.raises(ApiException) as e:
        v1.read_namespaced_pod_log(name, ns)
    assert e.value.status == 400 and "is waiting to start" in error(e.value)["message"]
    gone = v1.delete_namespaced_pod(name, ns)
    wait_pod(v1, ns, name, lambda kind, _: kind == "DELETED", since=gone.metadata.resource_version)


def test_exit_code_status_and_log(emu: Emu, v1: client.CoreV1Api, ns: str, image: str) -> None:
    cmd = ["python3", "-c", "print('hi'); import sys; sys.exit(3)"]
    name = v1.create_namespaced_pod(ns, pod(command=cmd, image=image)).metadata.name
    phases: list[str] = []

    def done(_: str, p: client.V1Pod) -> bool:
        phases.append(p.status.phase)
        return p.status.phase in ("Succeeded", "Failed")
    _, p = wait_pod(v1, ns, name, done)
    assert p.status.phase == "Failed" and phases[0] == "Pending"
    term = p.status.container_statuses[0].state.terminated
    assert term.exit_code == 3 and term.reason == "Error"
    assert term.started_at and term.finished_at and term.finished_at >= term.started_at
    assert p.status.pod_ip == p.status.host_ip == "127.0.0.1"
    assert p.status.container_statuses[0].container_id.startswith("docker://")
    assert v1.read_namespaced_pod_log(name, ns) == "hi\n"
    assert name in container_names(emu)  # an exited container is kept until its pod is deleted
    gone = v1.delete_namespaced_pod(name, ns)
    wait_pod(v1, ns, name, lambda kind, _: kind == "DELETED", since=gone.metadata.resource_version)
    assert name not in container_names(emu)


def test_command_args_env_workdir_and_tail(v1: client.CoreV1Api, ns: str, image: str) -> None:
    script = "import os; [print(i) for i in range(5)]; print(os.environ['FOO'], os.getcwd())"
    body = pod(image=image, command=["python3"], container={
        "args": ["-c", script], "working_dir": "/tmp", "env": [client.V1EnvVar(name="FOO", value="bar")],
        "resources": client.V1ResourceRequirements(limits={"cpu": "1", "memory": "256Mi"})})
    name = v1.create_namespaced_pod(ns, body).metadata.name
    _, p = wait_pod(v1, ns, name, lambda _, p: p.status.phase in ("Succeeded", "Failed"))
    assert p.status.phase == "Succeeded"
    term = p.status.container_statuses[0].state.terminated
    assert term.exit_code == 0 and term.reason == "Completed"
    assert v1.read_namespaced_pod_log(name, ns, tail_lines=2) == "4\nbar /tmp\n"
    v1.delete_namespaced_pod(name, ns, grace_period_seconds=0)


def test_host_network_reaches_loopback(v1: client.CoreV1Api, ns: str, image: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(WAIT)
        port = server.getsockname()[1]
        cmd = ["python3", "-c", f"import socket; socket.create_connection(('127.0.0.1', {port})).sendall(b'hello')"]
        name = v1.create_namespaced_pod(ns, pod(command=cmd, image=image)).metadata.name
        conn, _ = server.accept()
        with conn:
            conn.settimeout(WAIT)
            assert conn.recv(5) == b"hello"
    _, p = wait_pod(v1, ns, name, lambda _, p: p.status.phase in ("Succeeded", "Failed"))
    assert p.status.phase == "Succeeded"
    v1.delete_namespaced_pod(name, ns, grace_period_seconds=0)


def test_delete_running_pod_kills_and_removes_container(emu: Emu, v1: client.CoreV1Api, ns: str, image: str) -> None:
    body = pod(image=image, command=["python3", "-c", "import time; print('up', flush=True); time.sleep(300)"])
    name = v1.create_namespaced_pod(ns, body).metadata.name
    _, p = wait_pod(v1, ns, name, lambda _, p: p.status.phase == "Running")
    assert p.status.container_statuses[0].state.running.started_at
    assert p.status.container_statuses[0].ready
    stream = v1.read_namespaced_pod_log(name, ns, follow=True, _preload_content=False, _request_timeout=WAIT)
    assert stream.readline() == b"up\n"
    assert name in container_names(emu)
    deleted = v1.delete_namespaced_pod(name, ns, grace_period_seconds=1)
    assert deleted.metadata.deletion_timestamp is not None
    kind, p = wait_pod(v1, ns, name, lambda kind, _: kind == "DELETED", since=deleted.metadata.resource_version)
    # python as PID 1 ignores SIGTERM: killed after the grace period
    assert p.status.container_statuses[0].state.terminated.exit_code == 137
    assert stream.read() == b""  # the follow stream ends with the container
    stream.release_conn()
    assert name not in container_names(emu)


def test_start_error_when_command_is_missing(v1: client.CoreV1Api, ns: str, image: str) -> None:
    name = v1.create_namespaced_pod(ns, pod(image=image, command=["/no/such/binary"])).metadata.name
    _, p = wait_pod(v1, ns, name, lambda _, p: p.status.phase in ("Succeeded", "Failed"))
    term = p.status.container_statuses[0].state.terminated
    assert p.status.phase == "Failed" and term.reason == "StartError" and term.exit_code == 128
    assert "/no/such/binary" in term.message
    v1.delete_namespaced_pod(name, ns, grace_period_seconds=0)


def disruption(p: client.V1Pod) -> client.V1PodCondition | None:
    return next((c for c in p.status.conditions or [] if c.type == "DisruptionTarget"), None)


def test_eviction_marks_the_pod_then_deletes_it(emu: Emu, v1: client.CoreV1Api, ns: str, image: str,
                                                 restore_config: None) -> None:
    # As kube-apiserver >= 1.26: DisruptionTarget (EvictionByEvictionAPI), then a graceful delete.
    name = v1.create_namespaced_pod(ns, pod(image=image)).metadata.name
    _, p = wait_pod(v1, ns, name, lambda _, p: p.status.phase == "Running")
    since = p.metadata.resource_version
    with pytest.raises(ApiException) as e:
        v1.create_namespaced_pod_eviction(name, ns, client.V1Eviction(metadata=client.V1ObjectMeta(name="other")))
    assert e.value.status == 400 and error(e.value)["message"] == "name in URL does not match name in Eviction object"
    with pytest.raises(ApiException) as e:
        v1.create_namespaced_pod_eviction("no-such-pod", ns, client.V1Eviction(
            metadata=client.V1ObjectMeta(name="no-such-pod")))
    assert e.value.status == 404
    emu.admin("config", {"rbac": {"pods": ["get", "list", "watch", "delete"]}}, "PUT")
    with pytest.raises(ApiException) as e:
        v1.create_namespaced_pod_eviction(name, ns, client.V1Eviction(metadata=client.V1ObjectMeta(name=name)))
    assert e.value.status == 403 and 'cannot create resource "pods/eviction"' in error(e.value)["message"]
    emu.admin("config", {"rbac": None}, "PUT")
    v1.create_namespaced_pod_eviction(name, ns, client.V1Eviction(
        metadata=client.V1ObjectMeta(name=name), delete_options=client.V1DeleteOptions(grace_period_seconds=1)))
    _, p = wait_pod(v1, ns, name, lambda _, p: disruption(p) is not None, since=since)
    cond = disruption(p)
    assert (cond.status, cond.reason, cond.message) == ("True", "EvictionByEvictionAPI", "Eviction API: evicting")
    kind, p = wait_pod(v1, ns, name, lambda kind, _: kind == "DELETED", since=since)
    assert p.metadata.deletion_grace_period_seconds == 1 and disruption(p) is not None
    # `sleep` as PID 1 ignores SIGTERM: killed when the grace period ends
    assert p.status.container_statuses[0].state.terminated.exit_code == 137


# --- secrets ------------------------------------------------------------------------------------------


def test_secrets_are_stored_as_base64_and_collected_with_their_owner(v1: client.CoreV1Api, ns: str) -> None:
    owner = v1.create_namespaced_pod(ns, pod(node_selector={"emulator-test": "nowhere"}))
    ref = client.V1OwnerReference(api_version="v1", kind="Pod", name=owner.metadata.name, uid=owner.metadata.uid)
    name = "owned-" + uuid.uuid4().hex[:6]
    created = v1.create_namespaced_secret(ns, client.V1Secret(
        metadata=client.V1ObjectMeta(name=name, owner_references=[ref]), string_data={"k": "v"}))
    assert created.data == {"k": "dg=="} and created.string_data is None and created.type == "Opaque"
    with pytest.raises(ApiException) as e:
        v1.create_namespaced_secret(ns, client.V1Secret(metadata=client.V1ObjectMeta(name=name)))
    assert e.value.status == 409
    v1.delete_namespaced_pod(owner.metadata.name, ns, grace_period_seconds=0)
    with pytest.raises(ApiException) as e:  # the garbage collector deleted it with its owner
        v1.read_namespaced_secret(name, ns)
    assert e.value.status == 404


def test_secret_key_ref_gives_the_container_the_value(v1: client.CoreV1Api, ns: str, image: str) -> None:
    name = "key-" + uuid.uuid4().hex[:6]
    v1.create_namespaced_secret(ns, client.V1Secret(metadata=client.V1ObjectMeta(name=name),
                                                    data={"k": "c2VjcmV0"}))
    def env(key: str) -> dict[str, Any]:
        return {"env": [client.V1EnvVar(name="K", value_from=client.V1EnvVarSource(
            secret_key_ref=client.V1SecretKeySelector(name=name, key=key)))]}

    created = v1.create_namespaced_pod(ns, pod(command=["sh", "-c", "echo $K"], container=env("k")))
    wait_pod(v1, ns, created.metadata.name, lambda _, p: p.status.phase == "Succeeded")
    assert v1.read_namespaced_pod_log(created.metadata.name, ns) == "secret\n"
    created = v1.create_namespaced_pod(ns, pod(container=env("other")))
    _, p = wait_pod(v1, ns, created.metadata.name, lambda _, p: waiting_reason(p) == "CreateContainerConfigError")
    assert p.status.container_statuses[0].state.waiting.message == f"couldn't find key other in Secret {ns}/{name}"
    v1.delete_namespaced_pod(created.metadata.name, ns, grace_period_seconds=0)
    v1.delete_namespaced_secret(name, ns)


# --- what the API server stores, as it stores it -------------------------------------------------------


def test_quantities_are_stored_in_canonical_form(v1: client.CoreV1Api, ns: str) -> None:
    created = v1.create_namespaced_pod(ns, pod(node_selector={"emulator-test": "nowhere"}, container={
        "resources": client.V1ResourceRequirements(requests={"cpu": "0.5", "memory": "1024Mi"},
                                                   limits={"cpu": "1000m", "memory": "2048Mi"})}))
    res = v1.read_namespaced_pod(created.metadata.name, ns).spec.containers[0].resources
    assert res.limits == {"cpu": "1", "memory": "2Gi"}
    assert res.requests == {"cpu": "500m", "memory": "1Gi"}
    v1.delete_namespaced_pod(created.metadata.name, ns, grace_period_seconds=0)


@pytest.mark.parametrize("limits, qos", [
    ({"nvidia.com/gpu": "1"}, "BestEffort"),  # GPUs do not count
    ({"cpu": "1", "memory": "1Gi", "nvidia.com/gpu": "1"}, "Guaranteed"),
    ({"cpu": "1", "nvidia.com/gpu": "1"}, "Burstable"),
])
def test_qos_class_comes_from_cpu_and_memory_only(v1: client.CoreV1Api, ns: str, limits: dict[str, str],
                                                  qos: str) -> None:
    created = v1.create_namespaced_pod(ns, pod(node_selector={"emulator-test": "nowhere"}, container={
        "resources": client.V1ResourceRequirements(limits=limits)}))
    assert created.status.qos_class == qos
    v1.delete_namespaced_pod(created.metadata.name, ns, grace_period_seconds=0)


@pytest.mark.parametrize("automount", [None, False])
def test_the_service_account_token_volume_is_added(v1: client.CoreV1Api, ns: str, automount: bool | None) -> None:
    created = v1.create_namespaced_pod(ns, pod(node_selector={"emulator-test": "nowhere"},
                                               automount_service_account_token=automount))
    volumes = created.spec.volumes or []
    mounts = created.spec.containers[0].volume_mounts or []
    if automount is False:
        assert volumes == [] and mounts == []
    else:
        (volume,) = volumes
        assert volume.name.startswith("kube-api-access-") and len(volume.name) == len("kube-api-access-") + 5
        assert [s.service_account_token.path for s in volume.projected.sources if s.service_account_token] == ["token"]
        assert [(m.name, m.mount_path, m.read_only) for m in mounts] == [
            (volume.name, "/var/run/secrets/kubernetes.io/serviceaccount", True)]
        assert created.spec.service_account_name == "default"
    v1.delete_namespaced_pod(created.metadata.name, ns, grace_period_seconds=0)


def test_empty_optional_fields_are_dropped(v1: client.CoreV1Api, ns: str) -> None:
    body = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"generateName": "emu-", "labels": {}, "annotations": {}},
            "spec": {"restartPolicy": "Never", "nodeSelector": {}, "imagePullSecrets": [],
                     "containers": [{"name": "main", "image": IMAGE, "args": [], "env": [{"name": "E", "value": ""}],
                                     "workingDir": "", "resources": {"limits": {}}}]}}
    api = v1.api_client  # the raw JSON: the client's models would fill in what was left out
    resp = api.call_api(*api.param_serialize(
        method="POST", resource_path=f"/api/v1/namespaces/{ns}/pods", body=body, auth_settings=["BearerToken"],
        header_params={"Content-Type": "application/json", "Accept": "application/json"}))
    assert resp.status == 201
    created = json.loads(resp.read())
    assert "labels" not in created["metadata"] and "annotations" not in created["metadata"]
    assert "nodeSelector" not in created["spec"] and "imagePullSecrets" not in created["spec"]
    c = created["spec"]["containers"][0]
    assert "args" not in c and "workingDir" not in c and c["env"] == [{"name": "E"}]
    assert c["resources"] == {}  # an empty struct stays, as in the API server's JSON
    v1.delete_namespaced_pod(created["metadata"]["name"], ns, grace_period_seconds=0)


# --- batch/v1 Jobs and their controller ------------------------------------------------------------


def job(command: list[str], image: str, backoff: int = 0) -> client.V1Job:
    """A Job whose pods' disruptions (eviction, node loss) are not counted, as `fiber run --durable` makes."""
    policy = client.V1PodFailurePolicy(rules=[client.V1PodFailurePolicyRule(
        action="Ignore", on_pod_conditions=[client.V1PodFailurePolicyOnPodConditionsPattern(
            type="DisruptionTarget", status="True")])])
    spec = client.V1PodSpec(restart_policy="Never", containers=[client.V1Container(
        name="main", image=image, command=command)])
    return client.V1Job(metadata=client.V1ObjectMeta(generate_name="emujob-"), spec=client.V1JobSpec(
        backoff_limit=backoff, pod_failure_policy=policy, template=client.V1PodTemplateSpec(spec=spec)))


def until(check: Callable[[], Any], what: str) -> Any:
    """Poll the API (Jobs have no watch here) until ``check()`` returns something true."""
    import time

    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {WAIT} s")


def job_pods(v1: client.CoreV1Api, ns: str, name: str) -> list[client.V1Pod]:
    return v1.list_namespaced_pod(ns, label_selector=f"batch.kubernetes.io/job-name={name}").items


def job_ended(batch: client.BatchV1Api, ns: str, name: str, ctype: str) -> client.V1Job:
    def ended() -> client.V1Job | None:
        j = batch.read_namespaced_job(name, ns)
        return j if any(c.type == ctype and c.status == "True" for c in j.status.conditions or []) else None
    return until(ended, f"job {name} {ctype}")


def new_running_pod(v1: client.CoreV1Api, ns: str, name: str, old: set[str]) -> client.V1Pod:
    def running() -> client.V1Pod | None:
        return next((p for p in job_pods(v1, ns, name) if p.metadata.name not in old
                     and p.status.phase == "Running" and not p.metadata.deletion_timestamp), None)
    return until(running, f"a new running pod of job {name}")


def test_a_job_runs_its_pod_to_completion_and_counts_a_failure_against_its_limit(
        v1: client.CoreV1Api, ns: str, image: str) -> None:
    batch = client.BatchV1Api(v1.api_client)
    done = batch.create_namespaced_job(ns, job(["python3", "-c", "print('ok')"], image))
    j = job_ended(batch, ns, done.metadata.name, "Complete")
    assert j.status.succeeded == 1 and [c.type for c in j.status.conditions] == ["SuccessCriteriaMet", "Complete"]
    [p] = job_pods(v1, ns, done.metadata.name)
    assert p.metadata.owner_references[0].kind == "Job" and p.metadata.labels["job-name"] == done.metadata.name
    failing = batch.create_namespaced_job(ns, job(["python3", "-c", "raise SystemExit(3)"], image, backoff=1))
    j = job_ended(batch, ns, failing.metadata.name, "Failed")
    assert j.status.failed == 2 and j.status.conditions[-1].reason == "BackoffLimitExceeded"
    assert len(job_pods(v1, ns, failing.metadata.name)) == 2
    with pytest.raises(ApiException) as e:
        batch.create_namespaced_job(ns, client.V1Job(metadata=client.V1ObjectMeta(name="bad"), spec=client.V1JobSpec(
            template=client.V1PodTemplateSpec(spec=client.V1PodSpec(restart_policy="Always", containers=[
                client.V1Container(name="main", image=image)])))))
    assert e.value.status == 422 and "restartPolicy" in error(e.value)["message"]
    batch.delete_namespaced_job(failing.metadata.name, ns, propagation_policy="Background")
    with pytest.raises(ApiException) as e:
        batch.read_namespaced_job(failing.metadata.name, ns)
    assert e.value.status == 404
    until(lambda: not [p for p in job_pods(v1, ns, failing.metadata.name) if not p.metadata.deletion_timestamp],
          "the deleted job's pods deleted")


def test_a_job_replaces_a_pod_lost_to_eviction_or_node_loss_without_counting_it(
        emu: Emu, v1: client.CoreV1Api, ns: str, image: str, restore_config: None) -> None:
    emu.admin("config", {"nodes": [{"name": "node-a"}, {"name": "node-b"}]}, "PUT")
    batch = client.BatchV1Api(v1.api_client)
    name = batch.create_namespaced_job(ns, job(["sleep", "300"], image)).metadata.name
    first = new_running_pod(v1, ns, name, set())
    v1.create_namespaced_pod_eviction(first.metadata.name, ns, client.V1Eviction(
        metadata=client.V1ObjectMeta(name=first.metadata.name),
        delete_options=client.V1DeleteOptions(grace_period_seconds=1)))
    second = new_running_pod(v1, ns, name, {first.metadata.name})
    lost = emu.admin("lose-node", {"name": second.spec.node_name}, "POST")
    assert second.metadata.name in lost["pods"]
    third = new_running_pod(v1, ns, name, {first.metadata.name, second.metadata.name})
    assert third.spec.node_name != second.spec.node_name  # the lost node takes nothing any more
    j = until(lambda: (lambda j: j if j.status.active == 1 else None)(batch.read_namespaced_job(name, ns)),
              "the job's status counting its new pod")
    assert not j.status.failed and not j.status.conditions  # neither loss was counted
    batch.delete_namespaced_job(name, ns, propagation_policy="Background")
