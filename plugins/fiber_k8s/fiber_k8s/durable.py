"""``fiber run --durable``: the program's pod as a batch/v1 Job that outlives evictions and lost nodes.

The Job has one pod at a time, made from the pod ``fiber run`` would create. Its
``podFailurePolicy`` ignores a pod that ended with the condition ``DisruptionTarget`` (evicted
through the Eviction API or by the kubelet, preempted, its node drained or lost: the
condition Kubernetes >= 1.26 sets for each), so the Job controller starts the program again
without counting it; the program's own failures count against ``backoffLimit`` (the
``--retries`` of ``fiber run``, default 0: a failing program is not run again). Each start is
a new run of the program: with a journal (``FIBER_JOURNAL`` on a volume or object storage
that outlives the pod) it picks up where the last one was.

The manifest and the exit status are decided by pure functions here; :func:`follow` is the
I/O: it copies each pod's log in turn until the Job ends.
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable
from typing import Any, BinaryIO

from fiber_core.contract import BackendError

IGNORE_DISRUPTIONS = {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"


def job_manifest(pod: dict[str, Any], retries: int) -> dict[str, Any]:
    """The Job that runs ``pod`` (a pod manifest) again when it is disrupted."""
    if not isinstance(retries, int) or retries < 0:
        raise ValueError(f"--retries must be 0 or more, not {retries!r}")
    meta = pod["metadata"]
    spec = copy.deepcopy(pod["spec"])
    spec["restartPolicy"] = "Never"  # podFailurePolicy requires it; the Job makes a new pod instead
    template_meta = {k: copy.deepcopy(v) for k, v in meta.items() if k in ("labels", "annotations")}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": meta["name"], "namespace": meta.get("namespace"),
                         "labels": copy.deepcopy(meta.get("labels") or {})},
            "spec": {"backoffLimit": retries, "podFailurePolicy": {"rules": [IGNORE_DISRUPTIONS]},
                     "template": {"metadata": template_meta, "spec": spec}}}


def ended(job: dict[str, Any]) -> str | None:
    """``Complete`` or ``Failed`` once the Job has ended, else None."""
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("type") in ("Complete", "Failed") and c.get("status") == "True":
            return c["type"]
    return None


def exit_status(job: dict[str, Any], pods: list[dict[str, Any]]) -> int:
    """What ``fiber run`` exits with: 0 for a complete Job, else the last pod's exit code."""
    if ended(job) == "Complete":
        return 0
    for pod in sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "", reverse=True):
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated")
            if term and term.get("exitCode"):
                return int(term["exitCode"])
    return 1


def disruption(pod: dict[str, Any]) -> str | None:
    """Why the pod was disrupted (its ``DisruptionTarget`` condition), if it was."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "DisruptionTarget" and c.get("status") == "True":
            return f"{c.get('reason') or 'disrupted'}: {c.get('message') or ''}".rstrip(": ")
    return None


def follow(cluster: Any, name: str, container: str, out: BinaryIO | None = None,
           say: Callable[[str], None] = lambda m: print(f"fiber run: {m}", file=sys.stderr),
           poll: float = 0.5) -> int:
    """Copy the log of each of the Job's pods in turn, until the Job ends; its exit status."""
    out = out or sys.stdout.buffer
    followed: set[str] = set()
    while True:
        job = cluster.read_batch_job(name)
        pods = cluster.list_pods(f"{JOB_NAME_LABEL}={name}").get("items") or []
        if ended(job):
            return exit_status(job, pods)
        fresh = [p for p in sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "")
                 if p["metadata"]["name"] not in followed and (p.get("status") or {}).get("phase") != "Pending"]
        if not fresh:
            time.sleep(poll)  # the Job has no pod running yet: ask again (Jobs are not watched here)
            continue
        pod = fresh[0]
        pname = pod["metadata"]["name"]
        followed.add(pname)
        if len(followed) > 1:
            say(f"the program starts again in pod {pname} (start {len(followed)})")
        _copy_log(cluster, pname, container, out)
        try:
            last = cluster.read_pod(pname)
        except BackendError:
            continue  # deleted meanwhile (evicted, its node lost): the next pod says more
        why = disruption(last)
        if why:
            say(f"pod {pname} was disrupted ({why}); the Job starts the program again")


def _copy_log(cluster: Any, pod: str, container: str, out: BinaryIO) -> None:
    try:
        resp = cluster.pod_log(pod, container, follow=True)
    except BackendError:
        return  # gone before its log could be read
    try:
        for chunk in resp.stream(65536, decode_content=False):
            out.write(chunk)
            out.flush()
    except Exception:  # the stream broke with the pod (its node lost): go on with the Job
        pass
    finally:
        resp.release_conn()
