"""The ``kubernetes`` backend: every Fiber job is one pod.

How a job starts on Kubernetes, whole: :meth:`KubernetesBackend.create_job` builds the pod
(:func:`~fiber_k8s.spec.build_pod`: ``restartPolicy: Never``, the worker command under a small ``sh`` that
passes SIGTERM on, resources, GPU and node selector, labels ``fiber.run``/``fiber.parent``,
an ownerReference to the parent's own pod) and creates it. One watch per backend (label
selector ``fiber.run=<run>,fiber.parent=<this process>``) follows every pod of the run and
finishes each job's ``state`` when its pod ends (:func:`~fiber_k8s.status.pod_end` says with which code and
why), so polls never call the API. Terminating deletes the pod (with a grace period; kill:
grace 0); at exit every pod this process created is deleted.

The run's key is not in the pods: a Secret of the backend (:func:`build_secret`, owned by
the parent's own pod when there is one, so it goes with it) holds it, and each pod takes it
with ``secretKeyRef``. Who may read Secrets in the namespace (or exec into the pods, or
administer their nodes) can reach the parent; who may only ``get pods`` cannot. The Secret
is deleted at exit, and by ``fiber clean`` with the pods that refer to it.

A pod that cannot start fails its job instead of waiting forever: an image that cannot be
pulled (``ErrImagePull``...) at once, a pod that no node can take after ``schedule_timeout``.
Either way the job's exit code is 1, it ended :attr:`~EndReason.NEVER_STARTED`, and
:meth:`~KubernetesBackend.get_job_logs` says why.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fiber_core.contract import (
    ENV_AUTHKEY,
    ENV_OPTIONS,
    FALLBACK_WAIT,
    Backend,
    BackendError,
    EndReason,
    Job,
    JobSpec,
    Option,
    choice_text,
    remove_all,
    waiting_verdict,
)

from fiber_k8s.cluster import Cluster, http_status, in_pod
from fiber_k8s.podwatch import PodWatch
from fiber_k8s.spec import (
    CONTAINER,
    DEFAULT_GPU_LABEL,
    SECRET_KEY,
    build_pod,
    build_secret,
    choice_spec,
    label_value,
    load_pod_template,
    pod_name,
    secret_data,
    secret_name,
)
from fiber_k8s.status import (
    NO_EXIT_STATUS,
    container_status,
    pod_end,
    pod_start_failure,
    pod_unschedulable,
)

log = logging.getLogger("fiber")

OPTIONS: tuple[Option, ...] = (
    Option("kubeconfig", str, None, "kubeconfig file (default: the pod's service account, else $KUBECONFIG or ~/.kube/config)"),
    Option("context", str, None, "kubeconfig context (default: its current context)"),
    Option("namespace", str, None, "namespace of the pods (default: the parent pod's, else the kubeconfig context's, else default)"),
    Option("image", str, None, "image of the pods, with Python 3 and fiber-core (default: the global image setting, else the parent pod's image)"),
    Option("image_pull_policy", str, None, "imagePullPolicy of the pods (default: Kubernetes' own)",
           choices=("Always", "IfNotPresent", "Never")),
    Option("image_pull_secrets", list, [], "names of Secrets to pull the image with: regcred,other"),
    Option("service_account", str, None, "serviceAccountName of the job pods"),
    Option("tolerations", list, [], "tolerations, as key[=value][:Effect] (key:Effect tolerates any value)"),
    Option("node_selector", list, [], "node labels every pod requires, as key=value: pool=ml,zone=a"),
    Option("volumes", list, [], "mounts as SOURCE:PATH[:ro]; SOURCE is a PersistentVolumeClaim name, or a host path if it starts with /"),
    *ENV_OPTIONS,
    Option("gpu_resource", str, "nvidia.com/gpu", "extended resource that counts GPUs (amd.com/gpu)"),
    Option("gpu_label", str, DEFAULT_GPU_LABEL, "node label that gpu_type must equal (GKE: cloud.google.com/gke-accelerator)"),
    Option("schedule_timeout", float, 300.0, "seconds a pod may wait for a node before its job fails (0: forever); "
           "with GPU alternatives, the pod of the last one"),
    FALLBACK_WAIT,
    Option("spot_label", str, None, "node label of spot nodes, key=value, for capacity=spot/on-demand (GKE: "
           "cloud.google.com/gke-spot=true; EKS: eks.amazonaws.com/capacityType=SPOT; Karpenter: "
           "karpenter.sh/capacity-type=spot; AKS: kubernetes.azure.com/scalesetpriority=spot)"),
    Option("grace_period", int, 10, "seconds a terminated pod has between SIGTERM and SIGKILL"),
    Option("api_timeout", float, 30.0, "seconds one Kubernetes API call may take before it is an error; the watch may be down 4 times this before polls fail"),
    Option("signal_shell", bool, True, "run the command under /bin/sh, which passes SIGTERM on (a PID 1 ignores it)"),
    Option("create_concurrency", int, 10, "pods one start_jobs call creates at a time (a bound on the API requests in flight)"),
    Option("pod_template", str, None, "a Pod (YAML or JSON file, or inline JSON) whose labels, annotations and spec are merged into every pod"),
    Option("registry", str, None, "registry that `fiber run --build` pushes the image to (e.g. ghcr.io/me)"),
)


@dataclass
class _Pod:
    """``Job.handle`` of a pod: what the watch saw of it, and what Fiber asked of it."""

    created: float
    choice: int = 0  # which GPU alternative of the job's spec this pod asks for
    pod: dict[str, Any] | None = None
    deleted: bool = False
    stop_signal: int | None = None  # SIGTERM / SIGKILL once terminate / kill deleted it
    started: threading.Event = field(default_factory=threading.Event)  # the container ran, or the job ended


# -- the backend ----------------------------------------------------------------------------------


class KubernetesBackend(Backend):
    """Runs every job as a pod (``restartPolicy: Never``) in one namespace of a cluster."""

    name = "kubernetes"
    aliases = ("k8s",)
    options = OPTIONS
    package = "fiber-k8s"
    gpu_alternatives = True  # one pod per alternative, in order, each after fallback_wait (docs/placement.md)
    capacity_kinds = True  # by the spot_label setting: node affinity and a toleration (spec.capacity_terms)

    def __init__(self, settings: Mapping[str, Any] | None = None, run_id: str = "",
                 rundir: str | None = None) -> None:
        super().__init__(settings, run_id, rundir)
        self._lock = threading.RLock()
        self._cluster: Cluster | None = None
        self._own_pod: dict[str, Any] | None = None
        self._parent_id = ""
        self._watch: PodWatch | None = None  # made by the first create_job
        self._secret_name = secret_name(run_id)
        self._secrets: dict[str, dict[str, str]] = {}  # the Secrets made, by name: what each holds
        if self.settings.get("pod_template"):
            load_pod_template(self.settings["pod_template"])  # a bad template fails here, at once

    # -- connection, identity ----------------------------------------------------------------

    @property
    def cluster(self) -> Cluster:
        """The API connection, made on first use (BackendError if there is no cluster)."""
        with self._lock:
            if self._cluster is None:
                cluster = Cluster(self.settings)
                self._own_pod = cluster.own_pod()
                if self._own_pod is not None:
                    self._parent_id = self._own_pod["metadata"]["name"]
                else:
                    self._parent_id = label_value(f"{socket.gethostname()}-{os.getpid()}")
                self._cluster = cluster
            return self._cluster

    @property
    def namespace(self) -> str:
        return self.cluster.namespace

    @property
    def selector(self) -> str:
        """The label selector of the pods this process created in this run."""
        _ = self.cluster
        return f"fiber.run={label_value(self.run_id)},fiber.parent={self._parent_id}"

    def _labels(self, spec: JobSpec) -> dict[str, str]:
        labels = {k: label_value(v) for k, v in spec.labels.items()}
        labels["fiber.run"] = label_value(self.run_id or spec.labels.get("fiber.run", ""))
        labels["fiber.parent"] = self._parent_id  # unique per parent process, unlike its pid
        labels["fiber.name"] = label_value(spec.name)
        return labels

    def _image(self, spec: JobSpec) -> str:
        own = None
        if self._own_pod is not None:
            containers = self._own_pod["spec"]["containers"]
            own = (next((c for c in containers if c["name"] == CONTAINER), containers[0]))["image"]
        return self.job_image(spec, own, ", that the cluster can pull. Inside a pod Fiber uses the pod's own image.")

    def _owner(self) -> dict[str, Any] | None:
        owner = self._own_pod
        if owner is not None and owner["metadata"].get("namespace") != self.namespace:
            owner = None  # an ownerReference cannot cross namespaces
        return owner

    def manifest(self, spec: JobSpec, name: str | None = None, secret: str | None = None) -> dict[str, Any]:
        """The pod that :meth:`create_job` would create for ``spec`` (``fiber run --dry-run``),
        taking the key and the variables marked secret from the Secret ``secret`` (by default
        the backend's first)."""
        return build_pod(spec, self.settings, name=name or pod_name(spec.name, self.run_id),
                         namespace=self.namespace, image=self._image(spec), labels=self._labels(spec),
                         owner=self._owner(), secret=secret or self._secret_name)

    def _ensure_secret(self, spec: JobSpec) -> str:
        """The Secret that gives the pod of ``spec`` the run's key and the variables it marks
        secret: one this backend made that holds them all, or a new one (the first is
        :attr:`_secret_name`; a job marking other variables or values gets another, so a
        Secret is never changed under a pod that reads it)."""
        wanted = secret_data(spec.env, spec.secret_env)
        if SECRET_KEY not in wanted:
            return self._secret_name
        with self._lock:
            for name, held in self._secrets.items():
                if held[SECRET_KEY] != wanted[SECRET_KEY]:
                    raise BackendError(f"{spec.name} carries another run's key than the Secret "
                                       f"{name} of this backend: start it from a backend of its run")
                if all(held.get(k) == v for k, v in wanted.items()):
                    return name
            name = secret_name(self.run_id) if self._secrets else self._secret_name
            labels = {"fiber.run": label_value(self.run_id), "fiber.parent": self._parent_id}
            self.cluster.create_secret(build_secret(wanted, name=name, namespace=self.namespace,
                                                    labels=labels, owner=self._owner()))
            self._secrets[name] = wanted
            return name

    def _delete_secret(self) -> None:
        with self._lock:
            names, self._secrets = list(self._secrets), {}
        for name in names:
            try:
                self.cluster.delete_secret(name)
            except BackendError as e:
                if http_status(e) != 404:
                    log.warning("fiber: could not delete Secret %s of run %s: %s (remove it with `fiber clean "
                                "--backend kubernetes --run %s`, or kubectl delete secret %s)", name,
                                self.run_id, e, self.run_id, name)

    def get_listen_addr(self) -> str:
        """In a pod, the pod's IP; else an error saying what to set.

        Fiber asks this only when ``listen_host`` is not set. Without a cluster (no
        kubeconfig, not in a pod) that is the error: an address would not help.
        """
        if not in_pod():
            _ = self.cluster  # no cluster configured: say so first (it reads files, calls no API)
        if in_pod():
            ip = os.environ.get("POD_IP")
            if not ip:
                try:
                    ip = ((self.cluster and self._own_pod or {}).get("status") or {}).get("podIP")
                except BackendError:
                    pass
            return ip or socket.gethostbyname(socket.gethostname())
        raise BackendError(
            "the kubernetes backend does not know an address at which pods can reach this process: "
            "it runs outside the cluster (KUBERNETES_SERVICE_HOST is not set), and pods usually "
            "cannot route to a laptop or CI machine. Either run the program in the cluster "
            "(`fiber run python app.py`), or set listen_host (FIBER_LISTEN_HOST) to an address of "
            "this machine that the pods can connect to (a VPN or node-network IP).")

    # -- jobs ----------------------------------------------------------------------------------

    def create_job(self, spec: JobSpec) -> Job:
        cluster = self.cluster
        self._ensure_watch()
        secret = self._ensure_secret(spec)
        for _ in range(3):
            body = self.manifest(choice_spec(spec, 0), secret=secret)
            name = body["metadata"]["name"]
            job = self.track_job(Job(id=name, spec=spec, handle=_Pod(time.monotonic())))  # its first events
            try:  # may come before create_pod returns
                cluster.create_pod(body)
                return job
            except BackendError as e:
                self.untrack_job(job)
                if http_status(e) == 409:
                    continue  # the random part of the name collided
                raise
        raise BackendError(f"could not find a free pod name for {spec.name} in {cluster.namespace}")

    def _next_choice(self, job: Job, pod: _Pod, why: str) -> None:
        """Replace the waiting pod of ``job`` by one for its next GPU alternative (the job's id
        becomes the new pod's name), and delete the old one."""
        with self._lock:
            if job.handle is not pod or job.state.done() or pod.stop_signal is not None:
                return  # another poll moved it, or it ended or is being stopped
            old, index = job.id, pod.choice + 1
            spec = choice_spec(job.spec, index)
            alternatives = job.spec.alternatives
            secret = self._ensure_secret(spec)  # the one the first pod had: they hold the same
            for _ in range(3):
                body = self.manifest(spec, secret=secret)
                job.handle = _Pod(time.monotonic(), choice=index)
                self.rename_job(job, body["metadata"]["name"])  # before create_pod: its first events
                try:
                    self.cluster.create_pod(body)
                    break
                except BackendError as e:
                    if http_status(e) == 409:
                        continue  # the random part of the name collided
                    self._finish(job, NO_EXIT_STATUS, EndReason.NEVER_STARTED,
                                 f"could not create the pod of {alternatives[index]} for {job.spec.name}: {e}")
                    break
        waited = float(self.settings.get("fallback_wait") or 0)
        log.info("fiber: no node took %s (pod %s) for %s within fallback_wait=%gs%s; trying %s (pod %s)",
                 job.spec.name, old, alternatives[index - 1], waited, f": {why}" if why else "",
                 alternatives[index], job.id)
        threading.Thread(target=self._delete_quietly, args=(old,), daemon=True,
                         name=f"fiber-k8s-delete-{old}").start()

    @property
    def create_concurrency(self) -> int:  # type: ignore[override]
        """Pods a group start creates at a time: the ``create_concurrency`` setting."""
        return max(1, int(self.settings.get("create_concurrency") or 1))

    def create_jobs(self, specs: Sequence[JobSpec]) -> list[Job]:
        if specs:  # the watch and the Secret once, before the concurrent creations
            _ = self.cluster
            self._ensure_watch()
            self._ensure_secret(specs[0])
        return super().create_jobs(specs)

    def _ensure_watch(self) -> None:
        with self._lock:
            if self._watch is None:
                watch = PodWatch(self.cluster, self.selector, self.run_id, self._on_event, self._on_relist)
                watch.open()  # the first list and watch requests: errors are raised here
                watch.watcher = self.watch(watch.step, "watch", interval=0.1, max_backoff=5.0)
                self._watch = watch

    def _settle(self, job: Job) -> None:
        """Finish the job if what the watch saw of its pod says it ended."""
        p = job.handle
        if p.pod is None and not p.deleted:
            return
        pod = p.pod or {"metadata": {"name": job.id}}  # deleted before the watch saw it
        end = pod_end(pod, p.deleted, p.stop_signal)
        if end is not None:
            # A pod that cannot start is deleted, so that the kubelet stops retrying it.
            self._finish(job, *end, delete=not p.deleted and pod_start_failure(pod) is not None)
        elif "running" in (container_status(pod).get("state") or {}):
            p.started.set()

    def _finish(self, job: Job, code: int, reason: EndReason, detail: str, delete: bool = False) -> None:
        """Record the job's end (it leaves the live-job table); ``delete`` its pod too."""
        if job.state.finish(code, reason, detail) and delete:
            threading.Thread(target=self._delete_quietly, args=(job.id,), daemon=True,
                             name=f"fiber-k8s-delete-{job.id}").start()
        job.handle.started.set()

    def poll_job(self, job: Job) -> int | None:
        """The job's exit code as the watch saw it: no API call. Fails the job of a pod that
        waited for a node longer than ``schedule_timeout``; raises when the watch is lost."""
        if not job.state.done():
            p = job.handle
            timeout = float(self.settings.get("schedule_timeout") or 0)
            waiting = pod_unschedulable(p.pod)
            verdict = "wait" if waiting is None else waiting_verdict(
                p.choice, len(job.spec.alternatives), time.monotonic() - p.created,
                float(self.settings.get("fallback_wait") or 0), timeout)
            if verdict == "next":
                self._next_choice(job, p, waiting or "")
            elif verdict == "fail":
                tried = (f" (after {choice_text(job.spec.alternatives[:-1])}, each for fallback_wait="
                         f"{float(self.settings.get('fallback_wait') or 0):g}s)") if p.choice else ""
                self._finish(job, NO_EXIT_STATUS, EndReason.NEVER_STARTED, (
                    f"pod {job.id} was not scheduled within schedule_timeout={timeout:g}s{tried}: "
                    f"{waiting or 'no node took it'}. Check its cpu/memory/gpu/gpu_type requests, "
                    "node_selector and tolerations against the cluster's nodes, or raise "
                    "FIBER_KUBERNETES_SCHEDULE_TIMEOUT."), delete=True)
            else:
                watch = self._watch
                if watch is not None:
                    watch.raise_if_lost()
        return job.state.exitcode

    def wait_started(self, job: Job, timeout: float | None = None) -> int | None:
        """Block until the job's container runs, the job ends or ``timeout`` passes; return :meth:`poll_job`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.poll_job(job)  # fails a pod that waits past schedule_timeout; raises if the watch is lost
            left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if code is not None or left <= 0 or job.handle.started.wait(left):
                return self.poll_job(job)

    def _delete(self, name: str, grace: int) -> None:
        """Delete one pod; a pod already gone is not an error."""
        cluster = self.cluster
        try:
            cluster.delete_pod(name, grace)
        except BackendError as e:
            if http_status(e) != 404:
                raise

    def _delete_quietly(self, name: str) -> None:
        try:
            self._delete(name, 0)
        except BackendError as e:
            log.warning("fiber: could not delete pod %s: %s", name, e)

    def _stop(self, job: Job, sig: int, grace: int) -> None:
        if job.state.done():
            return
        with self._lock:  # not while _next_choice replaces the pod: the new one is stopped, or none is made
            p = job.handle
            if p.stop_signal != signal.SIGKILL:
                p.stop_signal = sig
            name = job.id
        self._delete(name, grace)

    def terminate_job(self, job: Job) -> None:
        self._stop(job, signal.SIGTERM, int(self.settings.get("grace_period") or 0))

    def kill_job(self, job: Job) -> None:
        self._stop(job, signal.SIGKILL, 0)

    def get_job_logs(self, job: Job) -> str:
        """The pod's log from the API (``""`` before it ran, while it has no node, or once it
        is deleted), then why the job ended when the cluster said more than its exit code."""
        cluster = self.cluster
        text = ""
        try:
            text = cluster.pod_log(job.id, CONTAINER)
        except BackendError as e:
            if http_status(e) not in (400, 404):  # 400: not started yet; 404: pod gone
                text = f"fiber: cannot read the logs of pod {job.id}: {e}\n"
        why = job.state.detail
        if why:
            text += ("" if not text or text.endswith("\n") else "\n") + f"fiber: {why}\n"
        return text

    # -- watch events --------------------------------------------------------------------------

    def _on_event(self, kind: str, pod: dict[str, Any]) -> None:
        job = self.job_by_id(pod["metadata"]["name"])
        if job is None:
            return
        p = job.handle
        p.pod = pod
        job.host = (pod.get("spec") or {}).get("nodeName") or job.host
        if kind == "DELETED":
            p.deleted = True
        self._settle(job)

    def _on_relist(self, names: set[str], started: float) -> None:
        """After a relist begun at ``started``: pods created before it and missing were deleted."""
        gone = [job for job in self.jobs if job.id not in names and job.handle.created < started]
        for job in gone:
            job.handle.deleted = True
            self._settle(job)

    # -- cleanup -------------------------------------------------------------------------------

    def cleanup(self) -> None:
        """Delete every pod this process created in the run, finished ones included."""
        jobs = self.take_jobs()  # their pods go below, all at once by label
        with self._lock:
            watch, self._watch = self._watch, None
        if watch is not None:
            watch.close()
            try:
                _delete_pods(watch.cluster, watch.selector)
            except BackendError as e:
                log.warning("fiber: could not delete the pods of run %s: %s (remove them with "
                            "`fiber clean --backend kubernetes --run %s`)", self.run_id, e, self.run_id)
        self._delete_secret()
        for job in jobs:  # the watch is closed: the ends of their pods will not be seen
            self._finish(job, -(job.handle.stop_signal or signal.SIGKILL), EndReason.STOPPED, "")
        super().cleanup()

    @classmethod
    def clean(cls, settings: Mapping[str, Any], run_id: str | None = None) -> list[str]:
        """Delete the pods of ``run_id`` (or of every Fiber run) in the configured namespace,
        and the Secrets they take the run's key from."""
        cluster = Cluster(settings)
        try:
            selector = f"fiber.run={label_value(run_id)}" if run_id else "fiber.run"
            listed = cluster.list_pods(selector).get("items") or []
            removed = [f"pod {cluster.namespace}/{name}" for name in _delete_pods(cluster, selector)]
            for name in sorted(_secrets_of(listed)):
                try:
                    cluster.delete_secret(name)
                    removed.append(f"secret {cluster.namespace}/{name}")
                except BackendError as e:
                    if http_status(e) != 404:
                        raise
            return removed
        finally:
            cluster.close()


def _secrets_of(pods: list[dict[str, Any]]) -> set[str]:
    """The names of the Fiber Secrets the containers of ``pods`` take the run's key from."""
    names = set()
    for pod in pods:
        for c in (pod.get("spec") or {}).get("containers") or []:
            for e in c.get("env") or []:
                ref = (e.get("valueFrom") or {}).get("secretKeyRef") or {}
                if e.get("name") == ENV_AUTHKEY and (ref.get("name") or "").startswith("fiber-key-"):
                    names.add(ref["name"])
    return names


def _delete_pods(cluster: Cluster, selector: str) -> list[str]:
    """Delete the pods matching ``selector`` at once (grace 0); return their names.

    One deletecollection call; without that verb, one delete per pod.
    """
    listed = cluster.list_pods(selector)
    names = [p["metadata"]["name"] for p in listed.get("items") or []]
    if not names:
        return []
    try:
        cluster.delete_pods(selector, 0)
    except BackendError as e:
        if http_status(e) != 403:
            raise
        def delete(name: str) -> None:
            try:
                cluster.delete_pod(name, 0)
            except BackendError as e2:
                if http_status(e2) != 404:
                    raise

        errors = remove_all(names, delete)
        if errors:
            raise errors[0] from None
    return names
