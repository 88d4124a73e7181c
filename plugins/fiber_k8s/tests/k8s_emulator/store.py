"""The emulator's object store: pods, namespaces, nodes, a watch history and the admin config."""

from __future__ import annotations

import copy
import datetime as dt
import os
import random
import re
import threading
import uuid
from collections.abc import Callable
from typing import Any

DEFAULT_USER = "system:serviceaccount:default:fiber"
DEFAULT_NODE = {"name": "emulator-node", "labels": {},
                "allocatable": {"cpu": "16", "memory": "64Gi", "pods": "110"}}
HISTORY = 5000  # watch events kept for resuming with resourceVersion
POD_FIELDS = {"metadata.name", "metadata.namespace", "spec.nodeName", "spec.restartPolicy",
              "spec.schedulerName", "spec.serviceAccountName", "spec.hostNetwork", "status.phase",
              "status.podIP", "status.nominatedNodeName"}


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def generated_name(base: str) -> str:
    """A name from ``generateName``: the base and five random characters, as the API server makes it."""
    return base[:58] + "".join(random.choices("bcdfghjklmnpqrstvwxz2456789", k=5))


def claim_metadata(obj: dict[str, Any], ns: str) -> dict[str, Any]:
    """The object's metadata, in namespace ``ns`` (another one in the body is the API server's
    400) and named from ``generateName`` when it has no name."""
    meta = obj.setdefault("metadata", {})
    if meta.get("namespace") not in (None, "", ns):
        raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the "
                       "namespace sent on the request")
    if not meta.get("name") and meta.get("generateName"):
        meta["name"] = generated_name(meta["generateName"])
    return meta


def default_config() -> dict[str, Any]:
    """`rbac` None allows every verb; otherwise {resource: [verbs]}. `token` None accepts any."""
    return {"user": DEFAULT_USER, "token": None, "rbac": None, "namespaces": ["default"],
            "nodes": [copy.deepcopy(DEFAULT_NODE)], "pull_backoff_seconds": 1.0}


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> dict[str, Any]:
        s = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
             "message": self.message, "reason": self.reason, "code": self.code}
        if self.details is not None:
            s["details"] = self.details
        return s


def not_found(kind: str, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{kind} "{name}" not found', {"name": name, "kind": kind})


# --- selectors -----------------------------------------------------------------------------------

_REQ = re.compile(r"^\s*(?P<neg>!)?\s*(?P<key>[A-Za-z0-9][-A-Za-z0-9_./]*)\s*"
                  r"(?:(?P<op>==|=|!=|\s+in\s+|\s+notin\s+)\s*(?P<val>.*?))?\s*$")


def parse_label_selector(text: str | None) -> Callable[[dict[str, str]], bool]:
    """Equality (=, ==, !=), set-based (in, notin) and existence (key, !key) requirements."""
    reqs: list[tuple[str, str, set[str]]] = []  # (key, op, values)
    for part in re.split(r",(?![^()]*\))", text or ""):
        if not part.strip():
            if text and text.strip():
                raise ApiError(400, "BadRequest", "unable to parse requirement: found '', expected: identifier")
            continue
        m = _REQ.match(part)
        if not m or (m["neg"] and m["op"]):
            raise ApiError(400, "BadRequest", f"unable to parse requirement: invalid label selector {part.strip()!r}")
        key, op, val = m["key"], (m["op"] or "").strip(), m["val"]
        if op in ("in", "notin"):
            if not (val.startswith("(") and val.endswith(")")):
                raise ApiError(400, "BadRequest", f"unable to parse requirement: found '{val}', expected: '('")
            reqs.append((key, op, {v.strip() for v in val[1:-1].split(",")}))
        else:
            reqs.append((key, "!exists" if m["neg"] else op or "exists", {val}))
    return lambda labels: all(_holds(labels, *r) for r in reqs)


def _holds(labels: dict[str, str], key: str, op: str, values: set[str]) -> bool:
    if op in ("exists", "!exists"):
        return (key in labels) == (op == "exists")
    return (labels.get(key) in values) == (op in ("=", "==", "in"))


def pod_field(pod: dict[str, Any], field: str) -> str:
    section, key = field.split(".", 1)
    value = (pod.get(section) or {}).get(key)
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


def parse_field_selector(text: str | None) -> Callable[[dict[str, Any]], bool]:
    reqs = []
    for part in filter(None, (text or "").split(",")):
        m = re.fullmatch(r"\s*([^!=\s]+)\s*(==|=|!=)\s*(.*?)\s*", part)
        if not m:
            raise ApiError(400, "BadRequest", f"invalid selector: '{text}'; can't understand '{part}'")
        field, op, value = m.groups()
        if field not in POD_FIELDS:
            raise ApiError(400, "BadRequest", f'"{field}" is not a known field selector: only '
                           + ", ".join(f'"{f}"' for f in sorted(POD_FIELDS)))
        reqs.append((field, op == "!=", value))
    return lambda pod: all((pod_field(pod, f) == v) != neg for f, neg, v in reqs)


# --- the store -----------------------------------------------------------------------------------


class Store:
    """All state behind one condition variable; every change of a pod becomes a watch event."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.cond = threading.Condition()
        self.initial_config = copy.deepcopy(config)
        self.config = copy.deepcopy(config)
        self.rv = 1
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self.jobs: dict[tuple[str, str], dict[str, Any]] = {}  # batch/v1 (jobs.py)
        self.namespaces: dict[str, dict[str, Any]] = {}
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.trimmed_rv = 0  # events up to this resourceVersion were dropped from the history
        self.wakeup = threading.Event()  # pokes the kubelet
        self.stopping = False
        for ns in config.get("namespaces") or ["default"]:
            self.add_namespace(ns)

    # namespaces and nodes
    def add_namespace(self, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
        with self.cond:
            if name in self.namespaces:
                raise ApiError(409, "AlreadyExists", f'namespaces "{name}" already exists',
                               {"name": name, "kind": "namespaces"})
            self.rv += 1
            ns = {"kind": "Namespace", "apiVersion": "v1",
                  "metadata": {"name": name, "uid": str(uuid.uuid4()), "resourceVersion": str(self.rv),
                               "creationTimestamp": now(),
                               "labels": {**(labels or {}), "kubernetes.io/metadata.name": name}},
                  "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}}
            self.namespaces[name] = ns
            return copy.deepcopy(ns)

    def get_namespace(self, name: str) -> dict[str, Any]:
        with self.cond:
            if name not in self.namespaces:
                raise not_found("namespaces", name)
            return copy.deepcopy(self.namespaces[name])

    def nodes(self) -> list[dict[str, Any]]:
        with self.cond:
            return [node_object(n) for n in self.config["nodes"]]

    # pods
    def _emit(self, kind: str, pod: dict[str, Any]) -> None:
        self.rv += 1
        pod["metadata"]["resourceVersion"] = str(self.rv)
        self.history.append((self.rv, kind, copy.deepcopy(pod)))
        if len(self.history) > 2 * HISTORY:
            self.trimmed_rv = self.history[HISTORY - 1][0]
            del self.history[:HISTORY]
        self.cond.notify_all()
        self.wakeup.set()

    def create_pod(self, pod: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        with self.cond:
            if ns not in self.namespaces:
                raise not_found("namespaces", ns)
            if (ns, name) in self.pods:
                raise ApiError(409, "AlreadyExists", f'pods "{name}" already exists',
                               {"name": name, "kind": "pods"})
            if dry_run:
                return copy.deepcopy(pod)
            self.pods[(ns, name)] = pod
            self._emit("ADDED", pod)
            return copy.deepcopy(pod)

    def get_pod(self, ns: str, name: str) -> dict[str, Any]:
        with self.cond:
            if (ns, name) not in self.pods:
                raise not_found("pods", name)
            return copy.deepcopy(self.pods[(ns, name)])

    def list_pods(self, ns: str | None, match: Callable[[dict[str, Any]], bool] = lambda p: True
                  ) -> tuple[list[dict[str, Any]], int]:
        with self.cond:
            items = [copy.deepcopy(p) for (pns, _), p in sorted(self.pods.items())
                     if (ns is None or pns == ns) and match(p)]
            return items, self.rv

    def update_pod(self, ns: str, name: str, uid: str, fn: Callable[[dict[str, Any]], None]) -> bool:
        """Apply fn to the pod (if it is still the same object); emit MODIFIED if it changed."""
        with self.cond:
            pod = self.pods.get((ns, name))
            if pod is None or pod["metadata"]["uid"] != uid:
                return False
            before = copy.deepcopy(pod)
            fn(pod)
            if pod != before:
                self._emit("MODIFIED", pod)
            return True

    def delete_pod(self, ns: str, name: str, grace: int | None, immediate: bool = False) -> dict[str, Any]:
        """Graceful delete: mark the pod and let the kubelet stop it; unbound pods go at once."""
        with self.cond:
            pod = self.pods.get((ns, name))
            if pod is None:
                raise not_found("pods", name)
            meta = pod["metadata"]
            if grace is None:
                grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
            if immediate or grace == 0 or not pod["spec"].get("nodeName"):
                return self.remove_pod(ns, name, meta["uid"]) or copy.deepcopy(pod)
            if meta.get("deletionTimestamp") is None or grace < meta.get("deletionGracePeriodSeconds", grace + 1):
                meta.setdefault("deletionTimestamp", now())
                meta["deletionGracePeriodSeconds"] = grace
                self._emit("MODIFIED", pod)
            return copy.deepcopy(pod)

    def remove_pod(self, ns: str, name: str, uid: str) -> dict[str, Any] | None:
        with self.cond:
            pod = self.pods.get((ns, name))
            if pod is None or pod["metadata"]["uid"] != uid:
                return None
            del self.pods[(ns, name)]
            # The garbage collector: what the pod owned goes with it (Secrets at once, pods
            # gracefully, as its background deletion does).
            for key, secret in list(self.secrets.items()):
                if any(r.get("uid") == uid for r in secret["metadata"].get("ownerReferences") or []):
                    del self.secrets[key]
            pod["metadata"].setdefault("deletionTimestamp", now())
            pod["metadata"].setdefault("deletionGracePeriodSeconds", 0)
            self._emit("DELETED", pod)
            for (ons, oname), owned in list(self.pods.items()):
                if any(r.get("uid") == uid for r in owned["metadata"].get("ownerReferences") or []):
                    self.delete_pod(ons, oname, None)
            return copy.deepcopy(pod)

    # secrets (no watch)
    def create_secret(self, secret: dict[str, Any]) -> dict[str, Any]:
        ns, name = secret["metadata"]["namespace"], secret["metadata"]["name"]
        with self.cond:
            if ns not in self.namespaces:
                raise not_found("namespaces", ns)
            if (ns, name) in self.secrets:
                raise ApiError(409, "AlreadyExists", f'secrets "{name}" already exists',
                               {"name": name, "kind": "secrets"})
            self.rv += 1
            secret["metadata"]["resourceVersion"] = str(self.rv)
            self.secrets[(ns, name)] = secret
            return copy.deepcopy(secret)

    def get_secret(self, ns: str, name: str) -> dict[str, Any]:
        with self.cond:
            if (ns, name) not in self.secrets:
                raise not_found("secrets", name)
            return copy.deepcopy(self.secrets[(ns, name)])

    def list_secrets(self, ns: str, match: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        with self.cond:
            return [copy.deepcopy(s) for (sns, _), s in sorted(self.secrets.items()) if sns == ns and match(s)]

    def delete_secret(self, ns: str, name: str) -> dict[str, Any]:
        with self.cond:
            if (ns, name) not in self.secrets:
                raise not_found("secrets", name)
            secret = self.secrets.pop((ns, name))
            return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                    "details": {"name": name, "kind": "secrets", "uid": secret["metadata"]["uid"]}}

    def events_after(self, rv: int) -> list[tuple[int, str, dict[str, Any]]] | None:
        """Events newer than rv, or None when rv is older than the kept history."""
        with self.cond:
            if rv < self.trimmed_rv:
                return None
            lo, hi = 0, len(self.history)
            while lo < hi:
                mid = (lo + hi) // 2
                if self.history[mid][0] <= rv:
                    lo = mid + 1
                else:
                    hi = mid
            return self.history[lo:]


def node_object(n: dict[str, Any]) -> dict[str, Any]:
    alloc = {"cpu": "16", "memory": "64Gi", "pods": "110", **{k: str(v) for k, v in (n.get("allocatable") or {}).items()}}
    name = n["name"]
    return {
        "kind": "Node", "apiVersion": "v1",
        "metadata": {"name": name, "uid": str(uuid.uuid5(uuid.NAMESPACE_DNS, name)), "resourceVersion": "1",
                     "creationTimestamp": "2024-01-01T00:00:00Z",
                     "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                "kubernetes.io/arch": "amd64", **(n.get("labels") or {})}},
        "spec": {"taints": n.get("taints") or None, "unschedulable": bool(n.get("unschedulable"))},
        "status": {
            "capacity": alloc, "allocatable": alloc,
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": name}],
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "kubelet is posting ready status",
                            "lastHeartbeatTime": now(), "lastTransitionTime": "2024-01-01T00:00:00Z"}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {"architecture": "amd64", "bootID": "", "containerRuntimeVersion": "docker://emulated",
                         "kernelVersion": os.uname().release, "kubeProxyVersion": "v1.30.0",
                         "kubeletVersion": "v1.30.0-fiber-emulator", "machineID": "", "operatingSystem": "linux",
                         "osImage": "fiber k8s emulator", "systemUUID": ""}}}
