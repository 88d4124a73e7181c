"""The watch on a Kubernetes backend's pods: list, then watch from the list's resourceVersion,
resume after each request, relist when the version is too old (410)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

from fiber_core.contract import BackendError, Watcher

from fiber_k8s.cluster import Cluster, http_status

WATCH_SECONDS = 240
"""Seconds one watch request stays open (the server's timeoutSeconds); then it is resumed."""


class PodWatch:
    """The one watch on the pods of a backend's selector, feeding its ``on_event`` callback.

    :meth:`open` lists the pods and opens the watch request; the first time in the caller's
    thread, so a missing permission is an error at the first ``create_job``. Then
    :meth:`step`, run by the backend's :class:`~fiber_core.contract.Watcher` (which backs off
    while it fails), reads events until the request ends, resumes from the last
    resourceVersion, and relists when that is too old (410). If the API stays unreachable for
    ``4 * api_timeout``, polling the jobs raises.
    """

    def __init__(self, cluster: Cluster, selector: str, run_id: str,
                 on_event: Callable[[str, dict[str, Any]], None],
                 on_relist: Callable[[set[str], float], None]) -> None:
        """``on_event(kind, pod)`` gets each pod event (the pods listed first, as MODIFIED);
        ``on_relist(names, started)`` the names a list found, and when it started."""
        self.cluster, self.selector, self.run_id = cluster, selector, run_id
        self.on_event, self.on_relist = on_event, on_relist
        self.rv, self.closed, self.error = "", False, ""
        self.resp: Any = None  # the open watch response
        self.down_since: float | None = None
        self.watcher: Watcher | None = None

    def open(self) -> None:
        started = time.monotonic()
        listed = self.cluster.list_pods(self.selector)
        for pod in listed.get("items") or []:
            self.on_event("MODIFIED", pod)
        self.on_relist({p["metadata"]["name"] for p in listed.get("items") or []}, started)
        self.rv = listed["metadata"]["resourceVersion"]
        self.resp = self.cluster.watch_pods(self.selector, self.rv, WATCH_SECONDS)

    def step(self) -> float:
        """One watch request's events; the next one starts at once."""
        from kubernetes.watch.watch import iter_resp_lines  # the client is loaded with the cluster

        try:
            if not self.rv:
                self.open()
            elif self.resp is None:
                self.resp = self.cluster.watch_pods(self.selector, self.rv, WATCH_SECONDS)
            if self.closed:
                return 0.0
            self.down_since = None
            for line in iter_resp_lines(self.resp):
                event = json.loads(line) if line else {}
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    if obj.get("code") != 410:
                        raise BackendError(f"watch error: {obj.get('message')}")
                    self.rv = ""  # too old: the next round relists
                    break
                self.rv = (obj.get("metadata") or {}).get("resourceVersion") or self.rv
                if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                    self.on_event(event["type"], obj)
            return 0.0
        except Exception as e:
            if not self.closed:
                if http_status(e) == 410:
                    self.rv = ""  # too old: the next round relists
                self.down_since, self.error = self.down_since or time.monotonic(), str(e)
            raise
        finally:
            resp, self.resp = self.resp, None
            if resp is not None:
                with contextlib.suppress(Exception):
                    resp.release_conn()

    def raise_if_lost(self) -> None:
        since = self.down_since
        if since is not None and time.monotonic() - since > 4 * self.cluster.timeout:
            raise BackendError(f"lost the watch on the pods of run {self.run_id} in namespace "
                               f"{self.cluster.namespace} for {time.monotonic() - since:.0f}s: {self.error}")

    def close(self) -> None:
        self.closed = True
        if self.watcher is not None:
            self.watcher.stop()
        resp = self.resp
        if resp is not None:
            with contextlib.suppress(Exception):
                resp.shutdown()  # unblocks the reading thread (urllib3 >= 2.3)
