"""Scheduler and test kubelet: bind pods to fake nodes, run them as host-network containers."""

from __future__ import annotations

import base64
import copy
import logging
import math
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from .dockerapi import Docker, DockerError
from .store import ApiError, Store, now
from .validation import parse_quantity

log = logging.getLogger("k8s_emulator.kubelet")
LABEL = "fiber-k8s-emulator"
TERMINAL = ("Succeeded", "Failed")


@dataclass
class Runtime:
    """What the kubelet knows about one pod beyond its API object."""
    containers: dict[str, str] = field(default_factory=dict)  # container name -> docker id
    retry_at: float = 0.0
    pull_failures: int = 0
    term_started: float | None = None


def pod_requests(pod: dict[str, Any]) -> dict[str, Decimal]:
    total = {"pods": Decimal(1)}
    for c in pod["spec"].get("containers") or []:
        for r, q in ((c.get("resources") or {}).get("requests") or {}).items():
            total[r] = total.get(r, Decimal(0)) + parse_quantity(q)
    return total


def tolerates(pod: dict[str, Any], taint: dict[str, Any]) -> bool:
    for t in pod["spec"].get("tolerations") or []:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("operator") == "Exists" and (not t.get("key") or t["key"] == taint.get("key")):
            return True
        if t.get("key") == taint.get("key") and t.get("value", "") == taint.get("value", ""):
            return True
    return False


def _term_matches(term: dict[str, Any], labels: dict[str, str]) -> bool:
    """One nodeSelectorTerm: every matchExpression holds (In, NotIn, Exists, DoesNotExist, Gt, Lt)."""
    for e in term.get("matchExpressions") or []:
        key, op, values = e.get("key"), e.get("operator"), e.get("values") or []
        have = labels.get(key)
        ok = {"In": have in values, "NotIn": have not in values, "Exists": key in labels,
              "DoesNotExist": key not in labels,
              "Gt": have is not None and have.isdigit() and bool(values) and int(have) > int(values[0]),
              "Lt": have is not None and have.isdigit() and bool(values) and int(have) < int(values[0])}.get(op, False)
        if not ok:
            return False
    return True


def node_matches(pod: dict[str, Any], labels: dict[str, str]) -> bool:
    """The pod's nodeSelector (every label equal) and its required node affinity (any term),
    as the scheduler's NodeAffinity filter checks them. Preferred affinity only scores nodes:
    it never keeps a pod off one."""
    if any(labels.get(k) != v for k, v in (pod["spec"].get("nodeSelector") or {}).items()):
        return False
    required = (((pod["spec"].get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = required.get("nodeSelectorTerms") or []
    return not terms or any(_term_matches(t, labels) for t in terms)


def schedule(pod: dict[str, Any], nodes: list[dict[str, Any]], pods: list[dict[str, Any]]) -> tuple[str | None, str]:
    """Pick a node like the default scheduler's filters; else the FailedScheduling message.

    The filters a placement depends on, as kube-scheduler applies them: the node is not
    cordoned, its NoSchedule/NoExecute taints are tolerated, its labels match the pod's
    nodeSelector and required node affinity, and the requests of the pods bound to it plus
    this pod's fit its allocatable (cpu, memory, pods and extended resources such as
    ``nvidia.com/gpu``, whose request the API server defaults from the limit)."""
    if not nodes:
        return None, "no nodes available to schedule pods"
    want, reasons, preempt = pod_requests(pod), Counter[str](), Counter[str]()
    for node in nodes:
        alloc = {k: parse_quantity(v) for k, v in node["status"]["allocatable"].items()}
        labels, name = node["metadata"]["labels"], node["metadata"]["name"]
        taints = [t for t in node["spec"].get("taints") or [] if t.get("effect") in ("NoSchedule", "NoExecute")]
        bad = next((t for t in taints if not tolerates(pod, t)), None)
        if node["spec"].get("unschedulable"):
            why = ["node(s) were unschedulable"]
        elif bad is not None:
            why = [f"node(s) had untolerated taint {{{bad.get('key')}: {bad.get('value', '')}}}"]
        elif not node_matches(pod, labels):
            why = ["node(s) didn't match Pod's node affinity/selector"]
        else:
            used: Counter[str] = Counter()
            for p in pods:
                if p["spec"].get("nodeName") == name and p["status"].get("phase") not in TERMINAL:
                    used.update(pod_requests(p))
            why = ["Too many pods" if r == "pods" else f"Insufficient {r}"
                   for r, q in sorted(want.items()) if q > 0 and used[r] + q > alloc.get(r, Decimal(0))]
            if not why:
                return name, ""
            preempt["No preemption victims found for incoming pod"] += 1
        if why[0].startswith("node(s)"):
            preempt["Preemption is not helpful for scheduling"] += 1
        reasons.update(why)
    n = len(nodes)
    fmt = lambda c: ", ".join(f"{count} {r}" for r, count in sorted(c.items()))  # noqa: E731
    return None, f"0/{n} nodes are available: {fmt(reasons)}. preemption: 0/{n} nodes are available: {fmt(preempt)}."


def set_condition(status: dict[str, Any], ctype: str, value: str, reason: str | None = None,
                  message: str | None = None) -> None:
    conds = status.setdefault("conditions", [])
    old = next((c for c in conds if c["type"] == ctype), None)
    new = {"type": ctype, "status": value, "lastProbeTime": None,
           "lastTransitionTime": old["lastTransitionTime"] if old and old["status"] == value else now()}
    if reason:
        new["reason"] = reason
    if message:
        new["message"] = message
    if old:
        conds[conds.index(old)] = new
    else:
        conds.append(new)


def refresh_phase(pod: dict[str, Any]) -> None:
    """Derive phase and Ready conditions from the container statuses (restartPolicy Never)."""
    st = pod["status"]
    cs = st.get("containerStatuses") or []
    states = [next(iter(c["state"])) for c in cs]
    if st.get("reason") == "Evicted":
        st["phase"] = "Failed"  # the kubelet ended it, whatever its containers still do
    elif states and all(s == "terminated" for s in states):
        failed = any(c["state"]["terminated"]["exitCode"] != 0 for c in cs)
        st["phase"] = "Failed" if failed else "Succeeded"
    elif states and "waiting" not in states:
        st["phase"] = "Running"
    else:
        st["phase"] = "Pending"
    ready = bool(states) and all(s == "running" for s in states)
    unready = [c["name"] for c in cs if "running" not in c["state"]]
    for ctype in ("Ready", "ContainersReady"):
        if ready:
            set_condition(st, ctype, "True")
        elif st["phase"] in TERMINAL:
            set_condition(st, ctype, "False", "PodCompleted")
        else:
            set_condition(st, ctype, "False", "ContainersNotReady",
                          f"containers with unready status: [{' '.join(unready)}]")
    for c in cs:
        c["ready"] = "running" in c["state"]
        c["started"] = "running" in c["state"]


def docker_time(t: str | None) -> str | None:
    return None if not t or t.startswith("0001-") else t[:19] + "Z"


def terminated_state(info: dict[str, Any], cid: str) -> dict[str, Any]:
    s = info["State"]
    code = s.get("ExitCode", 0)
    # As the kubelet reports it: a container SIGKILLed other than by the OOM killer (a kill -9
    # inside it) is exitCode 137 with reason Error; only the runtime's OOMKilled makes it OOMKilled.
    reason = "OOMKilled" if s.get("OOMKilled") else ("Completed" if code == 0 else "Error")
    term = {"exitCode": code, "reason": reason, "startedAt": docker_time(s.get("StartedAt")),
            "finishedAt": docker_time(s.get("FinishedAt")) or now(), "containerID": f"docker://{cid}"}
    if s.get("Error"):
        term["message"] = s["Error"]
    return {"terminated": term}


_VAR = re.compile(r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in env values, command and args ($$ escapes)."""
    return _VAR.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


class ConfigError(Exception):
    """A container cannot be configured (CreateContainerConfigError)."""


class Kubelet:
    def __init__(self, store: Store, docker: Docker | None, instance: str, api_port: int, poll: float = 0.2) -> None:
        self.store, self.docker, self.instance, self.api_port, self.poll = store, docker, instance, api_port, poll
        self.runtime: dict[str, Runtime] = {}
        self.inflight: set[str] = set()
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(4, thread_name_prefix="kubelet")
        self.thread = threading.Thread(target=self._loop, name="kubelet", daemon=True)

    # lifecycle
    def start(self) -> None:
        self.remove_all_containers()
        self.thread.start()

    def stop(self) -> None:
        self.store.stopping = True
        self.store.wakeup.set()
        self.thread.join(10)
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.remove_all_containers()

    def containers(self) -> list[dict[str, Any]]:
        if self.docker is None:
            return []
        try:
            return self.docker.list(f"{LABEL}.instance={self.instance}")
        except (OSError, DockerError):
            return []

    def remove_all_containers(self) -> None:
        for c in self.containers():
            try:
                self.docker.remove(c["Id"])  # type: ignore[union-attr]
            except (OSError, DockerError) as e:
                log.warning("cannot remove container %s: %s", c["Id"][:12], e)

    def _loop(self) -> None:
        while not self.store.stopping:
            self.store.wakeup.wait(self.poll)
            self.store.wakeup.clear()
            try:
                self.tick()
            except Exception:  # keep the kubelet alive; the log says what broke
                log.exception("kubelet tick failed")

    def _submit(self, uid: str, fn: Any, *args: Any) -> None:
        with self.lock:
            if uid in self.inflight:
                return
            self.inflight.add(uid)

        def run() -> None:
            try:
                fn(*args)
            except Exception:
                log.exception("kubelet task %s failed", fn.__name__)
            finally:
                with self.lock:
                    self.inflight.discard(uid)
                self.store.wakeup.set()
        self.pool.submit(run)

    # one pass over every pod
    def tick(self) -> None:
        with self.store.cond:
            pods = [copy.deepcopy(p) for p in self.store.pods.values()]
            backoff = float(self.store.config.get("pull_backoff_seconds", 1.0))
        nodes = self.store.nodes()
        for pod in pods:
            if not pod["spec"].get("nodeName") and not pod["metadata"].get("deletionTimestamp"):
                self.schedule(pod, nodes, pods)
        live = {p["metadata"]["uid"] for p in pods}
        states: dict[str, str] = {}
        if self.docker is not None and (pods or self.runtime):
            listing = self.containers()
            states = {c["Id"]: c["State"] for c in listing}
            for c in listing:
                if (c.get("Labels") or {}).get("io.kubernetes.pod.uid") not in live:
                    self._submit("orphan:" + c["Id"], self.docker.remove, c["Id"])
        for uid in list(self.runtime):
            with self.lock:
                busy = uid in self.inflight
            if uid not in live and not busy:
                del self.runtime[uid]
        t = time.monotonic()
        for pod in pods:
            meta = pod["metadata"]
            uid = meta["uid"]
            if not pod["spec"].get("nodeName"):
                continue
            with self.lock:
                if uid in self.inflight:
                    continue
            rt = self.runtime.setdefault(uid, Runtime())
            if meta.get("deletionTimestamp"):
                grace = meta.get("deletionGracePeriodSeconds", 0)
                running = [cid for cid in rt.containers.values() if states.get(cid) == "running"]
                if running and rt.term_started is None:
                    rt.term_started = t
                    for cid in running:
                        self.docker.kill(cid, "SIGTERM")  # type: ignore[union-attr]
                elif not running or t >= (rt.term_started or t) + grace:
                    self._submit(uid, self._finalize, pod, rt)
            elif pod["status"].get("phase") == "Pending" and not rt.containers:
                if t >= rt.retry_at:
                    rt.retry_at = t + backoff
                    self._submit(uid, self._start, pod, rt)
            elif rt.containers:
                gone = [n for n, cid in rt.containers.items() if states.get(cid, "missing") not in ("running", "created")]
                if any("running" in cs["state"] for cs in pod["status"].get("containerStatuses") or []
                       if cs["name"] in gone):
                    self._submit(uid, self._collect, pod, rt)

    def schedule(self, pod: dict[str, Any], nodes: list[dict[str, Any]], pods: list[dict[str, Any]]) -> None:
        node, message = schedule(pod, nodes, pods)
        meta = pod["metadata"]

        def bind(p: dict[str, Any]) -> None:
            if node:
                p["spec"]["nodeName"] = node
                set_condition(p["status"], "PodScheduled", "True")
            else:
                set_condition(p["status"], "PodScheduled", "False", "Unschedulable", message)
        if node:
            pod["spec"]["nodeName"] = node  # later pods of this pass see the capacity it takes
        self.store.update_pod(meta["namespace"], meta["name"], meta["uid"], bind)

    # tasks run on the pool
    def _update(self, pod: dict[str, Any], fn: Any) -> bool:
        m = pod["metadata"]
        return self.store.update_pod(m["namespace"], m["name"], m["uid"], fn)

    def _waiting(self, pod: dict[str, Any], reasons: dict[str, tuple[str, str]]) -> None:
        """Pod bound but not running: containers waiting with the given (reason, message)."""
        def fn(p: dict[str, Any]) -> None:
            st = p["status"]
            st.update(hostIP="127.0.0.1", hostIPs=[{"ip": "127.0.0.1"}], podIP="127.0.0.1",
                      podIPs=[{"ip": "127.0.0.1"}])
            st.setdefault("startTime", now())
            set_condition(st, "PodReadyToStartContainers", "True")
            set_condition(st, "Initialized", "True")
            st["containerStatuses"] = [
                {"name": c["name"], "image": c["image"], "imageID": "", "ready": False, "started": False,
                 "restartCount": 0, "lastState": {},
                 "state": {"waiting": dict(zip(("reason", "message"), reasons.get(c["name"], ("ContainerCreating", ""))))}}
                for c in p["spec"]["containers"]]
            for cs in st["containerStatuses"]:
                if not cs["state"]["waiting"].get("message"):
                    cs["state"]["waiting"].pop("message", None)
            refresh_phase(p)
        self._update(pod, fn)

    def _start(self, pod: dict[str, Any], rt: Runtime) -> None:
        containers = pod["spec"]["containers"]
        if self.docker is None or not self.docker.ping():
            where = self.docker.host if self.docker else "(none configured)"
            msg = f"test kubelet: docker daemon {where} is not reachable"
            self._waiting(pod, {c["name"]: ("CreateContainerError", msg) for c in containers})
            return
        if not pod["status"].get("containerStatuses"):
            self._waiting(pod, {})
        missing = {c["name"]: c for c in containers if not self.docker.image_exists(c["image"])}
        if missing:
            rt.pull_failures += 1
            reasons = {}
            for name, c in missing.items():
                img = c["image"]
                if c.get("imagePullPolicy") == "Never":
                    reasons[name] = ("ErrImageNeverPull", f'Container image "{img}" is not present with pull policy of Never')
                elif rt.pull_failures == 1:
                    reasons[name] = ("ErrImagePull", f'rpc error: code = Unknown desc = Error response from daemon: '
                                     f'pull access denied for {img}, repository does not exist or may require '
                                     f'\'docker login\' (k8s emulator: images are never pulled; load "{img}" '
                                     f'into the test dockerd)')
                else:
                    reasons[name] = ("ImagePullBackOff", f'Back-off pulling image "{img}"')
            self._waiting(pod, reasons)
            return
        try:
            configs = {c["name"]: self._container_config(pod, c) for c in containers}
        except ConfigError as e:
            self._waiting(pod, {c["name"]: ("CreateContainerConfigError", str(e)) for c in containers})
            return
        meta = pod["metadata"]
        try:
            for c in containers:
                cname = f"k8s_{c['name']}_{meta['name']}_{meta['namespace']}"[:200] + f"_{meta['uid'][:8]}"
                rt.containers[c["name"]] = self.docker.create(cname, configs[c["name"]])
        except DockerError as e:  # e.g. a bad mount: report it, clean up, retry after the backoff
            for cid in rt.containers.values():
                self.docker.remove(cid)
            rt.containers.clear()
            self._waiting(pod, {c["name"]: ("CreateContainerError", e.message) for c in containers})
            return
        results: dict[str, dict[str, Any]] = {}
        for c in containers:
            cid = rt.containers[c["name"]]
            try:
                self.docker.start(cid)
                info = self.docker.inspect(cid)
                if info["State"]["Running"]:
                    results[c["name"]] = {"running": {"startedAt": docker_time(info["State"]["StartedAt"]) or now()}}
                else:
                    results[c["name"]] = terminated_state(info, cid)
            except DockerError as e:
                results[c["name"]] = {"terminated": {
                    "exitCode": 128, "reason": "StartError", "message": e.message, "startedAt": "1970-01-01T00:00:00Z",
                    "finishedAt": now(), "containerID": f"docker://{cid}"}}

        def fn(p: dict[str, Any]) -> None:
            for cs in p["status"]["containerStatuses"]:
                cid = rt.containers[cs["name"]]
                cs.update(state=results[cs["name"]], containerID=f"docker://{cid}",
                          imageID=f"docker-pullable://{cs['image']}@{self._image_id(cs['image'])}")
            refresh_phase(p)
        self._update(pod, fn)

    def _image_id(self, image: str) -> str:
        try:
            return self.docker.image_id(image)  # type: ignore[union-attr]
        except (OSError, DockerError):
            return ""

    def _container_config(self, pod: dict[str, Any], c: dict[str, Any]) -> dict[str, Any]:
        meta, spec = pod["metadata"], pod["spec"]
        env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(self.api_port),
               "KUBERNETES_PORT": f"tcp://127.0.0.1:{self.api_port}"}
        for src in c.get("envFrom") or []:
            for kind in ("secretRef", "configMapRef"):
                ref = src.get(kind)
                if ref and not ref.get("optional"):
                    raise ConfigError(f'{"secret" if kind == "secretRef" else "configmap"} "{ref.get("name")}" not found')
        for e in c.get("env") or []:
            vf = e.get("valueFrom")
            if vf is None:
                env[e["name"]] = expand(e.get("value") or "", env)
            elif "fieldRef" in vf:
                env[e["name"]] = self._field_ref(pod, vf["fieldRef"]["fieldPath"])
            elif "resourceFieldRef" in vf:
                res, which = vf["resourceFieldRef"]["resource"].split(".", 1)
                q = ((c.get("resources") or {}).get(res) or {}).get(which)
                env[e["name"]] = str(math.ceil(parse_quantity(q))) if q is not None else ""
            elif "secretKeyRef" in vf:
                ref = vf["secretKeyRef"]
                try:
                    data = self.store.get_secret(meta["namespace"], ref.get("name") or "").get("data") or {}
                except ApiError:
                    if ref.get("optional"):
                        continue
                    raise ConfigError(f'secret "{ref.get("name")}" not found') from None
                if ref.get("key") in data:
                    env[e["name"]] = base64.b64decode(data[ref["key"]]).decode("utf-8", "replace")
                elif not ref.get("optional"):
                    raise ConfigError(f'couldn\'t find key {ref.get("key")} in Secret '
                                      f'{meta["namespace"]}/{ref.get("name")}')
            else:
                ref = vf.get("configMapKeyRef") or {}
                if not ref.get("optional"):
                    raise ConfigError(f'configmap "{ref.get("name")}" not found')
        limits = (c.get("resources") or {}).get("limits") or {}
        host: dict[str, Any] = {"NetworkMode": "host", "Binds": [], "Tmpfs": {}}
        if "cpu" in limits:
            host["NanoCpus"] = int(parse_quantity(limits["cpu"]) * 10**9)
        if "memory" in limits:
            host["Memory"] = host["MemorySwap"] = int(parse_quantity(limits["memory"]))
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        for m in c.get("volumeMounts") or []:
            v = volumes.get(m["name"], {})
            if "hostPath" in v:
                host["Binds"].append(f"{v['hostPath']['path']}:{m['mountPath']}{':ro' if m.get('readOnly') else ''}")
            elif "emptyDir" in v:
                host["Tmpfs"][m["mountPath"]] = ""
        cfg: dict[str, Any] = {
            "Image": c["image"], "Env": [f"{k}={v}" for k, v in env.items()], "WorkingDir": c.get("workingDir") or "",
            "Tty": bool(c.get("tty")), "OpenStdin": bool(c.get("stdin")), "HostConfig": host,
            "Labels": {LABEL: "1", f"{LABEL}.instance": self.instance, "io.kubernetes.pod.name": meta["name"],
                       "io.kubernetes.pod.namespace": meta["namespace"], "io.kubernetes.pod.uid": meta["uid"],
                       "io.kubernetes.container.name": c["name"]}}
        if c.get("command"):
            cfg["Entrypoint"] = [expand(a, env) for a in c["command"]]
        if c.get("args"):
            cfg["Cmd"] = [expand(a, env) for a in c["args"]]
        user = ((c.get("securityContext") or {}).get("runAsUser")
                or (spec.get("securityContext") or {}).get("runAsUser"))
        if user is not None:
            cfg["User"] = str(user)
        return cfg

    @staticmethod
    def _field_ref(pod: dict[str, Any], path: str) -> str:
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if m:
            return (pod["metadata"].get(m.group(1)) or {}).get(m.group(2), "")
        simple = {"metadata.name": pod["metadata"]["name"], "metadata.namespace": pod["metadata"]["namespace"],
                  "metadata.uid": pod["metadata"]["uid"], "spec.nodeName": pod["spec"].get("nodeName", ""),
                  "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
                  "status.hostIP": "127.0.0.1", "status.podIP": "127.0.0.1", "status.podIPs": "127.0.0.1",
                  "status.hostIPs": "127.0.0.1"}
        return simple.get(path, "")

    def _collect(self, pod: dict[str, Any], rt: Runtime) -> None:
        """Record the terminated state of containers that exited."""
        infos = {name: self.docker.inspect(cid) for name, cid in rt.containers.items()}  # type: ignore[union-attr]

        def fn(p: dict[str, Any]) -> None:
            for cs in p["status"].get("containerStatuses") or []:
                info = infos.get(cs["name"])
                if info and "running" in cs["state"] and not info["State"]["Running"]:
                    cs["state"] = terminated_state(info, rt.containers[cs["name"]])
            refresh_phase(p)
        self._update(pod, fn)

    def evict(self, pod: dict[str, Any], resource: str = "memory") -> dict[str, Any]:
        """Node-pressure eviction, as the kubelet's eviction manager does it (hard threshold).

        The pod becomes ``Failed`` with reason ``Evicted`` and a ``DisruptionTarget`` condition
        (``TerminationByKubelet``), its containers are killed at once, and the pod object
        stays (until someone deletes it). Returns the pod as marked.
        """
        meta = pod["metadata"]
        if not pod["spec"].get("nodeName") or pod["status"].get("phase") in TERMINAL:
            raise ApiError(409, "Conflict", f'pod "{meta["name"]}" is not running on a node: nothing to evict')
        message = f"The node was low on resource: {resource}. "

        def mark(p: dict[str, Any]) -> None:
            p["status"].update(phase="Failed", reason="Evicted", message=message)
            set_condition(p["status"], "DisruptionTarget", "True", "TerminationByKubelet", message)
        self._update(pod, mark)
        rt = self.runtime.get(meta["uid"])
        for cid in (rt.containers.values() if rt and self.docker else ()):
            self.docker.kill(cid)  # type: ignore[union-attr]  # the next tick records their end
        self.store.wakeup.set()
        return self.store.get_pod(meta["namespace"], meta["name"])

    def lose_node(self, name: str) -> dict[str, Any]:
        """A node that is gone for good, as the cluster sees it once it has given up on it.

        The node leaves the config (nothing is scheduled there again); its containers die
        with it (killed, nothing sent first); then, as PodGC does for pods of a node that no
        longer exists (Kubernetes >= 1.26), each of its pods becomes ``Failed`` with the
        condition ``DisruptionTarget`` (reason ``DeletionByPodGC``) and is deleted at once.
        """
        with self.store.cond:
            nodes = self.store.config["nodes"]
            if not any(n["name"] == name for n in nodes):
                raise ApiError(404, "NotFound", f'nodes "{name}" not found')
            self.store.config["nodes"] = [n for n in nodes if n["name"] != name]
            pods = [copy.deepcopy(p) for p in self.store.pods.values() if p["spec"].get("nodeName") == name]
        for pod in pods:
            rt = self.runtime.get(pod["metadata"]["uid"])
            for cid in (rt.containers.values() if rt and self.docker else ()):
                try:
                    self.docker.kill(cid)  # type: ignore[union-attr]
                except DockerError:
                    pass

            def mark(p: dict[str, Any]) -> None:
                p["status"].update(phase="Failed")
                set_condition(p["status"], "DisruptionTarget", "True", "DeletionByPodGC",
                              "PodGC: node no longer exists")
            self._update(pod, mark)
            m = pod["metadata"]
            self.store.remove_pod(m["namespace"], m["name"], m["uid"])
        self.store.wakeup.set()
        return {"node": name, "pods": [p["metadata"]["name"] for p in pods]}

    def _finalize(self, pod: dict[str, Any], rt: Runtime) -> None:
        """End of a graceful delete: kill what still runs, record it, remove containers and the pod."""
        if rt.containers and self.docker is not None:
            for cid in rt.containers.values():
                self.docker.kill(cid)
            infos = {}
            for name, cid in rt.containers.items():
                try:
                    infos[name] = self.docker.inspect(cid)
                except DockerError:
                    pass

            def fn(p: dict[str, Any]) -> None:
                for cs in p["status"].get("containerStatuses") or []:
                    if cs["name"] in infos and "terminated" not in cs["state"]:
                        cs["state"] = terminated_state(infos[cs["name"]], rt.containers[cs["name"]])
                refresh_phase(p)
            self._update(pod, fn)
            for cid in rt.containers.values():
                self.docker.remove(cid)
        m = pod["metadata"]
        self.store.remove_pod(m["namespace"], m["name"], m["uid"])
