"""batch/v1 Jobs and the Job controller, as kube-controller-manager runs them (one pod at a time).

What the emulator keeps of the real controller (Kubernetes 1.30, `pkg/controller/job`), for
what Fiber uses: a Job of ``parallelism`` 1 and ``completions`` 1 has at most one active pod,
made from its template with the labels ``batch.kubernetes.io/job-name``, ``job-name``,
``batch.kubernetes.io/controller-uid`` and ``controller-uid`` and an owner reference to the
Job. A pod that succeeds completes the Job (conditions ``SuccessCriteriaMet`` then
``Complete``). A pod that fails is judged by ``podFailurePolicy`` (rules in order; a rule
matches by ``onPodConditions`` or ``onExitCodes``; actions ``Ignore``: not counted, a new pod
is made; ``FailJob``: the Job fails with reason ``PodFailurePolicy``; ``Count``), else
counted; past ``backoffLimit`` counted failures the Job fails (``FailureTarget`` then
``Failed``, reason ``BackoffLimitExceeded``). A pod deleted before it ended counts as failed,
unless it carries ``DisruptionTarget`` (eviction, node loss). The delay before a pod that
follows a counted failure is the real one scaled down: ``job_backoff_seconds`` (config,
default 1 s) doubled per failure (the real controller starts at 10 s); an ignored failure is
replaced at once, as there. Deleting a Job with ``propagationPolicy`` ``Background`` or
``Foreground`` deletes its pods; without one they stay (the API's default for Jobs).
Not emulated: parallelism/completions above 1, indexed Jobs, suspend, TTL, activeDeadlineSeconds.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from .store import ApiError, Store, claim_metadata, generated_name, not_found, now

log = logging.getLogger("k8s_emulator")
TERMINAL = ("Succeeded", "Failed")


def check_job(job: Any, ns: str) -> dict[str, Any]:
    """A Job as the API server stores it, or the error it answers with."""
    if not isinstance(job, dict) or job.get("kind", "Job") != "Job":
        raise ApiError(400, "BadRequest", "the body of the request was not a Job")
    job = copy.deepcopy(job)
    job.update(kind="Job", apiVersion="batch/v1")
    meta = claim_metadata(job, ns)
    name = meta.get("name") or ""
    spec = job.get("spec") or {}
    template = spec.get("template") or {}
    problems = []
    if not name:
        problems.append("metadata.name: Required value: name or generateName is required")
    if not (template.get("spec") or {}).get("containers"):
        problems.append("spec.template.spec.containers: Required value")
    restart = (template.get("spec") or {}).get("restartPolicy")
    if restart not in ("Never", "OnFailure"):
        problems.append(f'spec.template.spec.restartPolicy: Required value: valid values: "OnFailure", "Never"'
                        f" (got {restart!r})")
    if spec.get("podFailurePolicy") and restart != "Never":
        problems.append("spec.podFailurePolicy: Invalid value: only allowed when restartPolicy is Never")
    for key in ("parallelism", "completions"):
        if spec.get(key, 1) != 1:
            problems.append(f"spec.{key}: k8s emulator: only 1 is emulated")
    if problems:
        raise ApiError(422, "Invalid", f'Job.batch "{name}" is invalid: {"; ".join(problems)}',
                       {"name": name, "group": "batch", "kind": "Job"})
    spec.setdefault("backoffLimit", 6)
    spec.setdefault("parallelism", 1)
    spec.setdefault("completions", 1)
    meta.update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=now())
    labels = {"batch.kubernetes.io/controller-uid": meta["uid"], "controller-uid": meta["uid"],
              "batch.kubernetes.io/job-name": name, "job-name": name}
    spec.setdefault("selector", {"matchLabels": {"batch.kubernetes.io/controller-uid": meta["uid"]}})
    tmeta = template.setdefault("metadata", {})
    tmeta["labels"] = {**(tmeta.get("labels") or {}), **labels}
    job["spec"] = spec
    job["status"] = {}
    return job


def _condition(job: dict[str, Any], ctype: str, reason: str, message: str) -> None:
    job["status"].setdefault("conditions", []).append({
        "type": ctype, "status": "True", "reason": reason, "message": message,
        "lastProbeTime": now(), "lastTransitionTime": now()})


def _finished(job: dict[str, Any]) -> bool:
    return any(c["type"] in ("Complete", "Failed") and c["status"] == "True"
               for c in job["status"].get("conditions") or [])


def _exit_codes(pod: dict[str, Any], container: str | None) -> list[int]:
    return [cs["state"]["terminated"]["exitCode"] for cs in pod["status"].get("containerStatuses") or []
            if "terminated" in cs.get("state", {}) and container in (None, cs["name"])]


def _rule_matches(rule: dict[str, Any], pod: dict[str, Any]) -> bool:
    conditions = {(c["type"], c.get("status")) for c in pod["status"].get("conditions") or []}
    for want in rule.get("onPodConditions") or []:
        if (want["type"], want.get("status", "True")) in conditions:
            return True
    codes = rule.get("onExitCodes")
    if codes:
        found = [c for c in _exit_codes(pod, codes.get("containerName")) if c != 0]
        values = set(codes.get("values") or [])
        if codes.get("operator") == "In":
            return any(c in values for c in found)
        return any(c not in values for c in found)
    return False


def judge(job: dict[str, Any], pod: dict[str, Any]) -> str:
    """What a failed pod means for its Job: ``Ignore``, ``FailJob`` or ``Count`` (pure)."""
    for rule in (job["spec"].get("podFailurePolicy") or {}).get("rules") or []:
        if _rule_matches(rule, pod):
            return rule.get("action", "Count")
    return "Count"


class JobController:
    """Keeps every Job's one pod, from the store's pod events (as a watch would)."""

    def __init__(self, store: Store, admit: Callable[[dict[str, Any], str], dict[str, Any]],
                 poll: float = 0.2) -> None:
        self.store, self.admit, self.poll = store, admit, poll
        self.accounted: dict[str, set[str]] = {}  # job uid -> pod uids whose end was counted or ignored
        self.next_pod_at: dict[str, float] = {}  # job uid -> when its next pod may be made
        self.thread = threading.Thread(target=self._loop, name="job-controller", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _loop(self) -> None:
        while not self.store.stopping:
            time.sleep(self.poll)
            try:
                self.tick()
            except Exception:  # keep the controller alive; the log says what broke
                log.exception("job controller tick failed")

    def _final_states(self) -> dict[str, dict[str, Any]]:
        """The last state of every pod a Job owns, the deleted ones too (from the event history)."""
        seen: dict[str, dict[str, Any]] = {}
        with self.store.cond:
            for _, kind, pod in self.store.history:
                if (pod["metadata"].get("labels") or {}).get("batch.kubernetes.io/controller-uid"):
                    seen[pod["metadata"]["uid"]] = {**pod, "_deleted": kind == "DELETED"}
            for pod in self.store.pods.values():  # what the history no longer holds, live
                if (pod["metadata"].get("labels") or {}).get("batch.kubernetes.io/controller-uid"):
                    seen[pod["metadata"]["uid"]] = {**copy.deepcopy(pod), "_deleted": False}
        return seen

    def tick(self) -> None:
        with self.store.cond:
            jobs = [copy.deepcopy(j) for j in self.store.jobs.values() if not _finished(j)]
        if not jobs:
            return
        finals = self._final_states()
        for job in jobs:
            self._reconcile(job, finals)

    def _reconcile(self, job: dict[str, Any], finals: dict[str, dict[str, Any]]) -> None:
        uid = job["metadata"]["uid"]
        mine = [p for p in finals.values()
                if p["metadata"]["labels"].get("batch.kubernetes.io/controller-uid") == uid]
        done = self.accounted.setdefault(uid, set())
        status: dict[str, Any] = {"active": 0}
        for pod in mine:
            puid, phase = pod["metadata"]["uid"], pod["status"].get("phase")
            if puid in done:
                continue
            ended = phase in TERMINAL or pod["_deleted"]
            if not ended:
                if not pod["metadata"].get("deletionTimestamp"):
                    status["active"] += 1
                continue
            done.add(puid)
            if phase == "Succeeded":
                self._end(job, "Complete", "CompletionsReached", "Reached expected number of succeeded pods")
                return
            action = judge(job, pod)
            if action == "FailJob":
                self._end(job, "Failed", "PodFailurePolicy",
                          f"Pod {job['metadata']['namespace']}/{pod['metadata']['name']} matched a FailJob rule")
                return
            if action == "Count":
                failed = self._update(job, lambda j: j["status"].update(failed=j["status"].get("failed", 0) + 1))
                if failed["status"]["failed"] > job["spec"]["backoffLimit"]:
                    self._end(job, "Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")
                    return
                base = float(self.store.config.get("job_backoff_seconds", 1.0))
                self.next_pod_at[uid] = time.monotonic() + base * 2 ** (failed["status"]["failed"] - 1)
        self._update(job, lambda j: j["status"].update(active=status["active"],
                                                       startTime=j["status"].get("startTime") or now()))
        if status["active"] == 0 and time.monotonic() >= self.next_pod_at.get(uid, 0.0):
            self._new_pod(job)

    def _update(self, job: dict[str, Any], fn: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        key = (job["metadata"]["namespace"], job["metadata"]["name"])
        with self.store.cond:
            stored = self.store.jobs.get(key)
            if stored is None or stored["metadata"]["uid"] != job["metadata"]["uid"]:
                return job
            fn(stored)
            return copy.deepcopy(stored)

    def _end(self, job: dict[str, Any], ctype: str, reason: str, message: str) -> None:
        target = "SuccessCriteriaMet" if ctype == "Complete" else "FailureTarget"

        def fn(j: dict[str, Any]) -> None:
            j["status"]["active"] = 0
            if ctype == "Complete":
                j["status"]["succeeded"] = 1
                j["status"]["completionTime"] = now()
            _condition(j, target, reason, message)
            _condition(j, ctype, reason, message)
        self._update(job, fn)

    def _new_pod(self, job: dict[str, Any]) -> None:
        meta, template = job["metadata"], copy.deepcopy(job["spec"]["template"])
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": template.get("metadata") or {},
               "spec": template["spec"]}
        pod["metadata"].update(
            name=generated_name(f"{meta['name']}-"),
            ownerReferences=[{"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"],
                              "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}])
        try:
            created = self.admit(pod, meta["namespace"])
        except ApiError as e:  # the real controller records an event and tries again later
            log.warning("job %s: cannot create its pod: %s", meta["name"], e)
            self.next_pod_at[meta["uid"]] = time.monotonic() + 5.0
            return
        self.store.create_pod(created)


def delete_job(store: Store, ns: str, name: str, propagation: str | None) -> dict[str, Any]:
    """Remove the Job; its pods go too with Background or Foreground propagation."""
    with store.cond:
        job = store.jobs.pop((ns, name), None)
        if job is None:
            raise not_found("jobs.batch", name)
        uid = job["metadata"]["uid"]
        pods = [p for p in store.pods.values()
                if (p["metadata"].get("labels") or {}).get("batch.kubernetes.io/controller-uid") == uid]
    if propagation in ("Background", "Foreground"):
        for pod in pods:
            try:
                store.delete_pod(ns, pod["metadata"]["name"], None)
            except ApiError:
                pass
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
            "details": {"name": name, "group": "batch", "kind": "jobs", "uid": uid}}
