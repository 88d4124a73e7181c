"""The pod of a job as fiber_k8s.spec builds it: pure, no cluster."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fiber_core.contract import BackendError, ConfigError, JobSpec

from fiber_k8s.backend import KubernetesBackend
from fiber_k8s.spec import (
    build_pod,
    build_secret,
    label_value,
    load_pod_template,
    pod_name,
    secret_data,
)


def test_gpu_label_setting_and_other_options() -> None:
    spec = JobSpec(command=["python3", "-c", "print('$(HOME)')"], name="p", gpu_type="nvidia-tesla-t4",
                   env={"A": "1"}, volumes={"/data": "/mnt/data"})
    body = build_pod(spec, {"gpu_label": "cloud.google.com/gke-accelerator", "tolerations": ["dedicated=ml:NoSchedule"],
                            "service_account": "runner", "image_pull_secrets": ["regcred"],
                            "volumes": ["results:/results", "/tmp:/host-tmp:ro"], "extra_env": ["B=2"],
                            "node_selector": ["pool=ml"], "grace_period": 10, "signal_shell": False},
                     name="p-1", namespace="ns", image="img:1", labels={"fiber.run": "r"})
    pod = body["spec"]
    c = pod["containers"][0]
    assert pod["nodeSelector"] == {"pool": "ml", "cloud.google.com/gke-accelerator": "nvidia-tesla-t4"}
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "1"}  # gpu_type alone asks for one GPU
    assert {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["serviceAccountName"] == "runner" and pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["volumes"] == [
        {"name": "vol-0", "persistentVolumeClaim": {"claimName": "results", "readOnly": False}},
        {"name": "vol-1", "hostPath": {"path": "/tmp"}}, {"name": "vol-2", "hostPath": {"path": "/data"}}]
    assert c["volumeMounts"] == [{"name": "vol-0", "mountPath": "/results"},
                                 {"name": "vol-1", "mountPath": "/host-tmp", "readOnly": True},
                                 {"name": "vol-2", "mountPath": "/mnt/data"}]
    assert c["command"] == ["python3", "-c", "print('$$(HOME)')"]  # no $(VAR) expansion by Kubernetes
    env = {e["name"]: e for e in c["env"]}
    assert env["A"]["value"] == "1" and env["B"]["value"] == "2"
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    with pytest.raises(BackendError, match="gpu=-1"):
        build_pod(JobSpec(command=["x"], gpu=-1), {}, name="p", namespace="n", image="i", labels={})


def test_names_and_label_values_are_valid() -> None:
    names = {pod_name("Process-1:2 weird/name" * 5, "conf0123abcd") for _ in range(50)}
    assert len(names) == 50
    for name in names:
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63
    assert pod_name("___", "RUN") .startswith("fiber-run-")
    assert label_value("-Process-1:2 x/y-") == "Process-1_2_x_y"
    assert len(label_value("x" * 100)) == 63


POD_TEMPLATE = """\
apiVersion: v1
kind: Pod
metadata:
  labels:
    kueue.x-k8s.io/queue-name: team-a
    fiber.run: not-this-one
  annotations:
    example.com/owner: es-team
spec:
  priorityClassName: research-low
  tolerations:
  - {key: spot, operator: Exists, effect: NoSchedule}
  affinity:
    nodeAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        nodeSelectorTerms:
        - matchExpressions:
          - {key: pool, operator: In, values: [cpu-spot]}
  nodeSelector: {zone: a}
  containers:
  - name: job
    image: not-this-image
    env:
    - {name: FROM_TEMPLATE, value: "1"}
    - {name: FIBER_BACKEND, value: not-this-one}
    resources:
      requests: {ephemeral-storage: 1Gi}
  - name: sidecar
    image: fiber-test:latest
    command: [sleep, "600"]
"""


def test_pod_template_is_merged_into_every_pod(tmp_path: Path) -> None:
    path = tmp_path / "pod.yaml"
    path.write_text(POD_TEMPLATE)
    spec = JobSpec(command=["python3", "-c", "pass"], name="w", env={"FIBER_BACKEND": "kubernetes"}, cpu=1,
                   backend_options={"node_selector": ["zone=b"], "tolerations": ["gpu:NoSchedule"]})
    pod = build_pod(spec, {"pod_template": str(path)}, name="w-1", namespace="ns", image="img",
                    labels={"fiber.run": "r1"})
    meta, pspec = pod["metadata"], pod["spec"]
    assert meta["labels"] == {"kueue.x-k8s.io/queue-name": "team-a", "fiber.run": "r1"}  # Fiber's label wins
    assert meta["annotations"] == {"example.com/owner": "es-team", "fiber.name": "w"}
    assert pspec["priorityClassName"] == "research-low"
    assert pspec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert pspec["nodeSelector"] == {"zone": "b"}  # a setting wins over the template's same key
    assert pspec["tolerations"] == [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"},
                                    {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pspec["restartPolicy"] == "Never"
    job, sidecar = pspec["containers"]
    assert job["name"] == "job" and job["image"] == "img" and job["command"][-3:] == ["python3", "-c", "pass"]
    env = {e["name"]: e.get("value") for e in job["env"]}
    assert env["FROM_TEMPLATE"] == "1" and env["FIBER_BACKEND"] == "kubernetes"
    assert [e["name"] for e in job["env"]].count("FIBER_BACKEND") == 1
    assert job["resources"] == {"limits": {"cpu": "1"}, "requests": {"ephemeral-storage": "1Gi", "cpu": "1"}}
    assert sidecar["name"] == "sidecar"
    # Inline JSON, and a PodTemplate, read the same.
    inline = json.dumps({"kind": "PodTemplate", "template": {"metadata": {"labels": {"a": "b"}}}})
    assert build_pod(spec, {"pod_template": inline}, name="w-2", namespace="ns", image="img",
                     labels={})["metadata"]["labels"] == {"a": "b"}


@pytest.mark.parametrize("text, says", [
    ("kind: Deployment\n", "is a Deployment: give a Pod or a PodTemplate"),
    ("metadata: {name: mine}\n", "metadata.name is Fiber's to set"),
    ("spec: {restartPolicy: Always}\n", "restartPolicy 'Always'"),
    ("- a list\n", "must be a Pod"),
    ("spec: [unclosed\n", "is not valid YAML"),
])
def test_bad_pod_template_fails_at_once_saying_what_to_change(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / f"t{abs(hash(text))}.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(says)):
        KubernetesBackend({"pod_template": str(path)}, "t1")
    with pytest.raises(ConfigError, match="cannot read"):
        load_pod_template(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_pod_template("{not json")


def test_a_pods_resources_key_and_owner() -> None:
    spec = JobSpec(command=["python3"], name="w", cpu=0.5, memory=256, cwd="/w",
                   env={"FIBER_AUTHKEY": "secret-key", "A": "1"})
    owner = {"metadata": {"name": "parent", "uid": "u1"}}
    pod = build_pod(spec, {"grace_period": 3}, name="w-1", namespace="ns", image="img", labels={"fiber.run": "r"},
                    owner=owner, secret="fiber-key-r")
    c = pod["spec"]["containers"][0]
    assert c["resources"] == {"limits": {"cpu": "500m", "memory": "256Mi"}, "requests": {"cpu": "500m", "memory": "256Mi"}}
    assert c["workingDir"] == "/w" and "volumeMounts" not in c and "imagePullPolicy" not in c
    env = {e["name"]: e for e in c["env"]}
    assert env["FIBER_AUTHKEY"] == {"name": "FIBER_AUTHKEY",
                                    "valueFrom": {"secretKeyRef": {"name": "fiber-key-r", "key": "authkey"}}}
    assert "secret-key" not in json.dumps(pod)  # the key is in the Secret, not the pod
    assert pod["spec"]["terminationGracePeriodSeconds"] == 3 and "nodeSelector" not in pod["spec"]
    assert pod["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Pod", "name": "parent", "uid": "u1"}]


def test_the_program_variables_are_in_the_pod_and_marked_secrets_only_by_reference() -> None:
    spec = JobSpec(command=["python3"], name="w", secret_env=("WANDB_API_KEY",),
                   env={"FIBER_AUTHKEY": "the-key", "WANDB_API_KEY": "wandb-secret", "OMP_NUM_THREADS": "4"})
    pod = build_pod(spec, {}, name="w-1", namespace="ns", image="img", labels={}, secret="fiber-key-r")
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["OMP_NUM_THREADS"] == {"name": "OMP_NUM_THREADS", "value": "4"}
    assert env["WANDB_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "fiber-key-r", "key": "env-WANDB_API_KEY"}}
    assert "wandb-secret" not in json.dumps(pod) and "the-key" not in json.dumps(pod)
    data = secret_data(spec.env, spec.secret_env)
    assert data == {"authkey": "the-key", "env-WANDB_API_KEY": "wandb-secret"}
    secret = build_secret(data, name="fiber-key-r", namespace="ns", labels={})
    assert set(secret["data"]) == {"authkey", "env-WANDB_API_KEY"}
