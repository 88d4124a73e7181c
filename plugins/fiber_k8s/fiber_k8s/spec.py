"""The pod of a job: pure translations of a :class:`~fiber_core.contract.JobSpec` and the
backend's settings into Kubernetes objects (the pod, the Secret of the run's key), and the
names and labels they carry. No API call: :mod:`fiber_k8s.backend` sends what these build.
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import os
import re
import secrets
from collections.abc import Mapping
from typing import Any

from fiber_core.contract import (
    ENV_AUTHKEY,
    ENV_NODE,
    BackendError,
    ConfigError,
    JobSpec,
    capacity_kinds,
    clean_name,
    gpu_count,
    job_environment,
    parse_pairs,
)

CONTAINER = "job"
"""Name of the one container of a job's pod."""
SECRET_KEY = "authkey"
"""The key of the run's key in the backend's Secret."""
DEFAULT_GPU_LABEL = "nvidia.com/gpu.product"
"""Node label matched against ``gpu_type`` (set by NVIDIA GPU feature discovery / GPU operator)."""

# PID 1 of a container ignores signals it has no handler for, so SIGTERM would not end a
# Python job until the grace period runs out. This shell runs the command as its child and
# passes SIGTERM/SIGINT on (also one that came before the child started); it exits with the
# child's status (143 when SIGTERM killed it). `n` counts signals: when one interrupted
# `wait`, it waits again for the child's own status.
SIGNAL_SHELL = ("n=0 p=\n"
                "trap 'n=$((n+1)); [ -z \"$p\" ] || kill -TERM $p 2>/dev/null' TERM\n"
                "trap 'n=$((n+1)); [ -z \"$p\" ] || kill -INT $p 2>/dev/null' INT\n"
                '"$@" & p=$!\n'
                "[ $n = 0 ] || kill -TERM $p 2>/dev/null\n"
                "while m=$n; wait $p; s=$?; [ $m != $n ] && [ $s -gt 128 ]; do :; done\n"
                "exit $s")


_TOLERATION = re.compile(r"^(?P<key>[^=:]+)(?:=(?P<value>[^:]*))?(?::(?P<effect>NoSchedule|PreferNoSchedule|NoExecute))?$")



# -- names, labels and the pod manifest -------------------------------------------------------


def label_value(text: str) -> str:
    """``text`` as a valid label value: ``[A-Za-z0-9_.-]``, alphanumeric at both ends, at most 63."""
    return clean_name(text, sub="_", limit=63, fallback="")


def pod_name(process_name: str, run_id: str) -> str:
    """A unique DNS-1123 label from the process name and run id: ``process-1-2-<run>-<random>``."""
    run = clean_name(run_id, "a-z0-9-", lower=True, limit=20, fallback="run")
    base = clean_name(process_name, "a-z0-9-", lower=True, limit=63 - len(run) - 8, fallback="fiber")
    return f"{base}-{run}-{secrets.token_hex(3)}"


def quantity_cpu(cpu: float) -> str:
    return str(int(cpu)) if float(cpu).is_integer() else f"{round(cpu * 1000)}m"


def parse_tolerations(items: list[str]) -> list[dict[str, str]]:
    """``key=value:Effect`` (Equal), ``key:Effect`` or ``key`` (Exists) as pod tolerations."""
    out = []
    for item in items:
        m = _TOLERATION.match(item.strip())
        if not m:
            raise ConfigError(f"bad toleration {item!r}: expected key[=value][:NoSchedule|PreferNoSchedule|NoExecute]")
        t = {"key": m["key"].strip(), "operator": "Equal" if m["value"] is not None else "Exists"}
        if m["value"] is not None:
            t["value"] = m["value"]
        if m["effect"]:
            t["effect"] = m["effect"]
        out.append(t)
    return out


def parse_volumes(mounts: Mapping[str, str] | list[str]) -> tuple[list[dict], list[dict]]:
    """Pod volumes and container mounts from ``SOURCE:PATH[:ro]`` strings or ``{source: path}``.

    A SOURCE starting with ``/`` is a host path; anything else names a PersistentVolumeClaim.
    """
    entries: list[tuple[str, str, bool]] = []
    if isinstance(mounts, Mapping):
        entries = [(src, dst, False) for src, dst in mounts.items()]
    else:
        for item in mounts:
            parts = item.split(":")
            ro = len(parts) == 3 and parts[2] == "ro"
            if len(parts) not in (2, 3) or not parts[0] or not parts[1].startswith("/") or (len(parts) == 3 and not ro):
                raise ConfigError(f"bad volume {item!r}: expected SOURCE:/path[:ro] (SOURCE a claim name or /host/path)")
            entries.append((parts[0], parts[1], ro))
    volumes: list[dict[str, Any]] = []
    mounts_out: list[dict[str, Any]] = []
    for i, (src, dst, ro) in enumerate(entries):
        name = f"vol-{i}"
        if src.startswith("/"):
            volumes.append({"name": name, "hostPath": {"path": src}})
        else:
            volumes.append({"name": name, "persistentVolumeClaim": {"claimName": src, "readOnly": ro}})
        mount: dict[str, Any] = {"name": name, "mountPath": dst}
        if ro:
            mount["readOnly"] = True
        mounts_out.append(mount)
    return volumes, mounts_out


def secret_name(run_id: str) -> str:
    """A unique name for the Secret of one backend of run ``run_id``: ``fiber-key-<run>-<random>``."""
    run = clean_name(run_id, "a-z0-9-", lower=True, limit=40, fallback="run")
    return f"fiber-key-{run}-{secrets.token_hex(4)}"


def build_secret(value: str, *, name: str, namespace: str, labels: Mapping[str, str],
                 owner: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The Secret that gives the pods the run's key (``value``, hex) under :data:`SECRET_KEY`."""
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if owner:
        metadata["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": owner["metadata"]["name"],
                                        "uid": owner["metadata"]["uid"]}]
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": metadata,
            "data": {SECRET_KEY: base64.b64encode(value.encode()).decode()}}


# -- a user's pod template --------------------------------------------------------------------

_TEMPLATE_METADATA = ("labels", "annotations")


@functools.lru_cache(maxsize=8)
def load_pod_template(value: str) -> dict[str, Any]:
    """The ``pod_template`` setting as ``{"metadata": ..., "spec": ...}``.

    ``value`` is inline JSON (it starts with ``{``) or the path of a YAML or JSON file
    holding a ``Pod``, a ``PodTemplate`` or a bare ``{metadata, spec}``. Errors name the
    setting and what to change.
    """
    where = "inline" if value.lstrip().startswith("{") else value
    if where == "inline":
        try:
            doc = json.loads(value)
        except ValueError as e:
            raise ConfigError(f"pod_template (inline) is not valid JSON: {e}") from None
    else:
        import yaml  # the kubernetes client depends on PyYAML

        try:
            with open(os.path.expanduser(value), encoding="utf-8") as f:
                doc = yaml.safe_load(f)
        except OSError as e:
            raise ConfigError(f"pod_template: cannot read {value!r}: {e.strerror or e}. Give the path of "
                              "a YAML or JSON file holding a Pod, or the Pod as inline JSON") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"pod_template {value!r} is not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"pod_template ({where}) must be a Pod (a mapping with metadata and spec), "
                          f"not {type(doc).__name__}")
    kind = doc.get("kind", "Pod")
    if kind == "PodTemplate":
        doc = doc.get("template") or {}
    elif kind != "Pod":
        raise ConfigError(f"pod_template ({where}) is a {kind}: give a Pod or a PodTemplate")
    metadata, spec = doc.get("metadata") or {}, doc.get("spec") or {}
    if not isinstance(metadata, dict) or not isinstance(spec, dict):
        raise ConfigError(f"pod_template ({where}): metadata and spec must be mappings")
    other = sorted(set(metadata) - set(_TEMPLATE_METADATA))
    if other:
        raise ConfigError(f"pod_template ({where}): metadata.{other[0]} is Fiber's to set; a template "
                          "gives only labels and annotations")
    if spec.get("restartPolicy", "Never") != "Never":
        raise ConfigError(f"pod_template ({where}): restartPolicy {spec['restartPolicy']!r}: a job's pod "
                          "runs once (Never); remove it")
    for c in spec.get("containers") or []:
        if not isinstance(c, dict):
            raise ConfigError(f"pod_template ({where}): spec.containers must be a list of mappings")
    return {"metadata": {k: metadata[k] for k in _TEMPLATE_METADATA if k in metadata}, "spec": spec}


def _merge(ours: Any, theirs: Any) -> Any:
    """Fiber's value with the template's added: mappings merged (Fiber's keys win), lists
    concatenated (the template's first), else Fiber's value."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out = copy.deepcopy(theirs)
        for k, v in ours.items():
            out[k] = _merge(v, theirs[k]) if k in theirs else v
        return out
    if isinstance(ours, list) and isinstance(theirs, list):
        return [*copy.deepcopy(theirs), *ours]
    return ours


def merge_pod_template(pod: dict[str, Any], template: Mapping[str, Any]) -> dict[str, Any]:
    """``pod`` with ``template`` (from :func:`load_pod_template`) merged in.

    What Fiber sets wins where both give a field (its own labels, the command, the
    image, a setting such as ``service_account``); the template adds everything
    else: labels and annotations, tolerations, affinity, a priority class, a node
    selector's other keys, volumes, init containers, sidecars. The template's
    container named ``job`` (or its only container) is merged into the job's
    container; env entries Fiber sets replace the template's of the same name.
    """
    meta = template["metadata"]
    for key in _TEMPLATE_METADATA:
        if meta.get(key):
            pod["metadata"][key] = {**meta[key], **pod["metadata"].get(key, {})}
    tspec = copy.deepcopy(template["spec"])
    tcontainers = tspec.pop("containers", None) or []
    spec = pod["spec"]
    mine = spec["containers"][0]
    same = [c for c in tcontainers if c.get("name") == CONTAINER]
    if not same and len(tcontainers) == 1 and not tcontainers[0].get("name"):
        same = tcontainers
    for c in same:
        ours_env = {e["name"] for e in mine.get("env", [])}
        theirs_env = [e for e in c.pop("env", None) or [] if e.get("name") not in ours_env]
        c.pop("name", None)
        merged = _merge(mine, c)
        if theirs_env:
            merged["env"] = [*theirs_env, *mine.get("env", [])]
        mine = merged
    spec["containers"] = [mine, *[c for c in tcontainers if not any(c is s for s in same)]]
    pod["spec"] = _merge(spec, tspec)
    return pod


def _scheduling(spec: JobSpec, opts: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, str],
                                                                   dict[str, str], list[dict[str, str]]]:
    """(limits, requests, node selector, tolerations) of a job: its CPUs, memory and GPUs."""
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}
    if spec.cpu:
        requests["cpu"] = limits["cpu"] = quantity_cpu(spec.cpu)
    if spec.memory:
        requests["memory"] = limits["memory"] = f"{int(spec.memory)}Mi"
    gpu = gpu_count(spec)
    node_selector = parse_pairs(opts.get("node_selector") or [], "node_selector")
    tolerations = parse_tolerations(list(opts.get("tolerations") or []))
    if gpu < 0:
        raise BackendError("gpu=-1 (every GPU of a node) cannot be asked of Kubernetes: give a number of GPUs")
    if gpu:
        gpu_resource = opts.get("gpu_resource") or "nvidia.com/gpu"
        limits[gpu_resource] = str(gpu)  # the API server sets the request from the limit
        # GPU nodes are commonly tainted with the resource name; tolerating it is harmless elsewhere.
        tolerations.append({"key": gpu_resource, "operator": "Exists", "effect": "NoSchedule"})
        if spec.gpu_type:
            node_selector[opts.get("gpu_label") or DEFAULT_GPU_LABEL] = spec.gpu_type
    return limits, requests, node_selector, tolerations


def _env(spec: JobSpec, opts: Mapping[str, Any], secret: str | None) -> list[dict[str, Any]]:
    """The container's env: the pod's own fields, extra_env, the spec's; the key from ``secret``."""
    env: dict[str, Any] = {
        "POD_NAME": {"fieldRef": {"fieldPath": "metadata.name"}},
        "POD_NAMESPACE": {"fieldRef": {"fieldPath": "metadata.namespace"}},
        "POD_IP": {"fieldRef": {"fieldPath": "status.podIP"}},
        ENV_NODE: {"fieldRef": {"fieldPath": "spec.nodeName"}},  # the host of current_process().resources
    }
    env.update(job_environment(spec.env, opts.get("extra_env"), "[kubernetes]"))
    if secret and ENV_AUTHKEY in env:
        env[ENV_AUTHKEY] = {"secretKeyRef": {"name": secret, "key": SECRET_KEY}}
    return [{"name": k, "valueFrom": v} if isinstance(v, dict) else {"name": k, "value": str(v)}
            for k, v in env.items()]


def _volumes(spec: JobSpec, opts: Mapping[str, Any]) -> tuple[list[dict], list[dict]]:
    """The ``volumes`` setting's mounts, then the spec's, numbered in that order."""
    volumes, mounts = parse_volumes(list(opts.get("volumes") or []))
    more_volumes, more_mounts = parse_volumes(spec.volumes)
    for v, m in zip(more_volumes, more_mounts):
        m["name"] = v["name"] = f"vol-{len(volumes)}"
        volumes.append(v)
        mounts.append(m)
    return volumes, mounts


def _set(target: dict[str, Any], **values: Any) -> None:
    """Set the keys of ``values`` that have a value (not ``None``, empty or false)."""
    target.update({k: v for k, v in values.items() if v})


def build_pod(spec: JobSpec, settings: Mapping[str, Any], *, name: str, namespace: str, image: str,
              labels: Mapping[str, str], owner: Mapping[str, Any] | None = None,
              secret: str | None = None) -> dict[str, Any]:
    """The pod manifest of one job. ``settings`` are the backend's, overridden by
    ``spec.backend_options`` (any option key, e.g. ``service_account``). With ``secret``,
    the run's key (``FIBER_AUTHKEY`` of ``spec.env``) comes from that Secret, not the spec."""
    opts = {**settings, **spec.backend_options}
    limits, requests, node_selector, tolerations = _scheduling(spec, opts)
    # $(VAR) in command and args is expanded by Kubernetes: $$ keeps a literal $.
    argv = [a.replace("$", "$$") for a in spec.command]
    if opts.get("signal_shell", True):
        argv = ["/bin/sh", "-c", SIGNAL_SHELL, "fiber-job", *argv]
    container: dict[str, Any] = {"name": CONTAINER, "image": image, "command": argv, "env": _env(spec, opts, secret)}
    if limits:
        container["resources"] = {"limits": limits, **({"requests": requests} if requests else {})}
    volumes, mounts = _volumes(spec, opts)
    _set(container, workingDir=spec.cwd, imagePullPolicy=opts.get("image_pull_policy"), volumeMounts=mounts)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": int(opts.get("grace_period") or 0),
        "enableServiceLinks": False,
        "containers": [container],
    }
    _set(pod_spec, serviceAccountName=opts.get("service_account"),
         imagePullSecrets=[{"name": s} for s in opts.get("image_pull_secrets") or []],
         nodeSelector=node_selector, tolerations=tolerations, volumes=volumes)
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": dict(labels),
        "annotations": {"fiber.name": spec.name},
    }
    if owner:
        metadata["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": owner["metadata"]["name"],
                                        "uid": owner["metadata"]["uid"]}]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}
    if opts.get("pod_template"):
        pod = merge_pod_template(pod, load_pod_template(opts["pod_template"]))
    return _on_capacity(pod, spec, opts)


def _on_capacity(pod: dict[str, Any], spec: JobSpec, opts: Mapping[str, Any]) -> dict[str, Any]:
    """``pod`` kept on the capacity kind of ``spec`` (after the template: each of its terms too)."""
    kinds = capacity_kinds(spec.capacity)
    expressions, tolerations = capacity_terms(kinds[0] if kinds else None, opts.get("spot_label"))
    if tolerations:
        pod["spec"]["tolerations"] = [*(pod["spec"].get("tolerations") or []), *tolerations]
    return require_node(pod, expressions)


def choice_spec(spec: JobSpec, choice: int) -> JobSpec:
    """The spec of the pod for alternative ``choice`` (0-based) of ``spec``
    (``JobSpec.alternatives``: GPU types within capacity kinds): that type and count, that
    capacity kind, and the record that tells the job what it got. A job that names neither as it is."""
    alternatives = spec.alternatives
    if not alternatives:
        return spec
    return spec.choosing(alternatives[choice])


SPOT_LABELS = {
    "gke": "cloud.google.com/gke-spot=true",
    "eks": "eks.amazonaws.com/capacityType=SPOT",
    "karpenter": "karpenter.sh/capacity-type=spot",
    "aks": "kubernetes.azure.com/scalesetpriority=spot",
}
"""The label of spot nodes on the managed clusters (GKE Spot VMs, EKS managed node groups,
Karpenter, AKS spot node pools): what the ``spot_label`` setting is set to there."""


def capacity_terms(kind: str | None, spot_label: str | None) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """(node affinity match expressions, tolerations) that keep a pod on ``kind`` of capacity:
    a spot pod requires ``spot_label`` (``key=value``) and tolerates NoSchedule taints of its
    key (AKS taints its spot nodes so; others may); an on-demand pod requires its absence (a
    node without the label, or with another value, as EKS's ``ON_DEMAND``)."""
    if kind is None:
        return [], []
    key, sep, value = (spot_label or "").partition("=")
    if not sep or not key.strip() or not value.strip():
        raise ConfigError(
            f"capacity={kind!r} needs [kubernetes] spot_label (FIBER_KUBERNETES_SPOT_LABEL), the label of "
            f"spot nodes as key=value{'' if not spot_label else f' (not {spot_label!r})'}: "
            + "; ".join(f"{where.upper()}: {label}" for where, label in SPOT_LABELS.items()))
    key, value = key.strip(), value.strip()
    if kind == "spot":
        return ([{"key": key, "operator": "In", "values": [value]}],
                [{"key": key, "operator": "Exists", "effect": "NoSchedule"}])
    return [{"key": key, "operator": "NotIn", "values": [value]}], []


def require_node(pod: dict[str, Any], expressions: list[dict[str, Any]]) -> dict[str, Any]:
    """``pod`` with ``expressions`` required of its node: added to every required node
    affinity term (terms are ORed: each must hold them), or as the one term if it has none."""
    if not expressions:
        return pod
    affinity = pod["spec"].setdefault("affinity", {}).setdefault("nodeAffinity", {})
    required = affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({})
    for term in terms:
        term["matchExpressions"] = [*(term.get("matchExpressions") or []), *copy.deepcopy(expressions)]
    return pod
