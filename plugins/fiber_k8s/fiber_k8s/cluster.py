"""Talking to the Kubernetes API: finding the cluster, the namespace, this process's own pod,
and turning API errors into :class:`~fiber_core.base.errors.BackendError` that say what to do.

The official ``kubernetes`` client is imported here, when a backend first needs the
cluster, never when the plugin is loaded.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from typing import Any

from fiber_core.contract import BackendError

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
"""Where Kubernetes mounts a pod's service account: ``token``, ``ca.crt``, ``namespace``."""

RBAC_HINT = ("grant it with the Role in fiber_k8s/rbac.yaml (`python -m fiber_k8s.rbac --namespace "
             "NAMESPACE | kubectl apply -f -`) and run as its service account `fiber` (see the "
             "fiber-k8s README)")


def in_pod() -> bool:
    """True when this process runs in a Kubernetes pod (the kubelet sets KUBERNETES_SERVICE_HOST)."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _kubeconfig_paths(setting: str | None) -> list[str]:
    raw = setting or os.environ.get("KUBECONFIG") or "~/.kube/config"
    return [os.path.expanduser(p) for p in raw.split(os.pathsep) if p]


def no_cluster_message(paths: list[str]) -> str:
    where = ", ".join(paths)
    if in_pod():
        why = (f"this process runs in a pod but has no service account token ({SA_DIR}/token: is "
               "automountServiceAccountToken false?)")
    else:
        why = "this process is not in a pod (KUBERNETES_SERVICE_HOST is not set)"
    return (f"no Kubernetes cluster configured: {why}, and no kubeconfig was found at {where}. "
            "Point KUBECONFIG or FIBER_KUBERNETES_KUBECONFIG at a kubeconfig file (e.g. from "
            "`gcloud container clusters get-credentials`, `aws eks update-kubeconfig` or "
            "`kind get kubeconfig`), or run the program inside the cluster with `fiber run`.")


class Cluster:
    """One connection to the API server, with the namespace that jobs go to.

    :meth:`request` makes one API call with the backend's timeout and wraps its errors; the
    methods below it are the pod calls Fiber makes.
    """

    def __init__(self, settings: Mapping[str, Any]) -> None:
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException

        self.timeout = float(settings.get("api_timeout") or 30.0)
        kubeconfig, context = settings.get("kubeconfig"), settings.get("context")
        context_ns = None
        if not kubeconfig and in_pod() and os.path.exists(os.path.join(SA_DIR, "token")):
            conf = client.Configuration()
            try:
                config.load_incluster_config(client_configuration=conf)
            except ConfigException as e:
                raise BackendError("cannot use this pod's service account to reach the cluster: check "
                                   f"its token and CA in {SA_DIR}", cause=e) from None
            self.where = "the pod's service account"
        else:
            paths = _kubeconfig_paths(kubeconfig)
            if not any(os.path.isfile(p) for p in paths):
                raise BackendError(no_cluster_message(paths))
            path = os.pathsep.join(paths)
            try:
                conf = client.Configuration()
                config.load_kube_config(config_file=path, context=context, client_configuration=conf,
                                        persist_config=False)
                contexts, current = config.list_kube_config_contexts(path)
                chosen = next((c for c in contexts if c["name"] == context), current) if context else current
                context_ns = ((chosen or {}).get("context") or {}).get("namespace")
            except (ConfigException, OSError, ValueError, KeyError, TypeError) as e:
                raise BackendError(f"cannot load kubeconfig {path}"
                                   f"{f' (context {context})' if context else ''}. Check the file, "
                                   "or choose another with KUBECONFIG / FIBER_KUBERNETES_KUBECONFIG.",
                                   cause=e) from None
            self.where = f"kubeconfig {path}" + (f" (context {context})" if context else "")
        self.api = client.ApiClient(conf)
        self.host = conf.host
        self.namespace: str = (settings.get("namespace") or _read(os.path.join(SA_DIR, "namespace"))
                               or (os.environ.get("POD_NAMESPACE") if in_pod() else None)
                               or context_ns or "default")

    def request(self, verb: str, resource: str, method: str, path: str, query: Mapping[str, Any] | None = None,
                body: Any = None, stream: bool = False, timeout: Any = None, api: str = "/api/v1") -> Any:
        """One API request with the official client's ``ApiClient``; errors wrapped in BackendError.

        ``path`` is relative to ``<api>/namespaces/<namespace>`` (``api``: the core group's
        ``/api/v1``, or a group's, such as ``/apis/batch/v1``). Returns the decoded JSON
        (plain dicts: the client's model classes take seconds to import and are not needed),
        the text of a ``text/plain`` answer, or with ``stream`` the unread ``urllib3``
        response (watches, followed logs). ``verb`` and ``resource`` name the permission the
        request needs, for the error message.
        """
        from kubernetes.client.exceptions import ApiException

        headers = {"Accept": "application/json, */*"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        params = [(k, str(v).lower() if isinstance(v, bool) else v) for k, v in (query or {}).items()
                  if v is not None]
        try:
            req = self.api.param_serialize(method=method, resource_path=f"{api}/namespaces/{{namespace}}{path}",
                                           path_params={"namespace": self.namespace}, query_params=params,
                                           header_params=headers, body=body, auth_settings=["BearerToken"])
            resp = self.api.call_api(*req, _request_timeout=timeout or self.timeout)
            if not 200 <= resp.status <= 299:
                resp.read()
                raise ApiException.from_response(http_resp=resp, body=None, data=None)
        except ApiException as e:
            raise api_error(e, verb, resource, self.namespace) from None
        except Exception as e:  # urllib3 / socket errors: the server is not reachable
            raise BackendError(
                f"cannot reach the Kubernetes API server at {self.host} (from {self.where}) to {verb} "
                f"{resource}. Check that the cluster is up and reachable from here.", cause=e) from None
        if stream:
            return resp.response
        data = resp.read()
        if "json" not in (resp.getheader("Content-Type") or "json"):
            return data.decode("utf-8", "replace")
        return json.loads(data) if data else None

    # -- the calls Fiber makes (the verbs of rbac.yaml) ----------------------------------------

    def create_pod(self, body: Mapping[str, Any], dry_run: bool = False) -> dict[str, Any]:
        return self.request("create", "pods", "POST", "/pods", {"dryRun": "All" if dry_run else None}, body)

    def read_pod(self, name: str) -> dict[str, Any]:
        return self.request("get", "pods", "GET", f"/pods/{name}")

    def list_pods(self, selector: str) -> dict[str, Any]:
        return self.request("list", "pods", "GET", "/pods", {"labelSelector": selector})

    def watch_pods(self, selector: str, resource_version: str, seconds: int) -> Any:
        """An open watch response: one JSON event per line, for ``seconds`` at most."""
        return self.request("watch", "pods", "GET", "/pods",
                            {"labelSelector": selector, "watch": True, "resourceVersion": resource_version,
                             "allowWatchBookmarks": True, "timeoutSeconds": seconds},
                            stream=True, timeout=(self.timeout, seconds + self.timeout))

    def delete_pod(self, name: str, grace: int) -> dict[str, Any]:
        return self.request("delete", "pods", "DELETE", f"/pods/{name}", {"gracePeriodSeconds": grace})

    def delete_pods(self, selector: str, grace: int) -> dict[str, Any]:
        return self.request("deletecollection", "pods", "DELETE", "/pods",
                            {"labelSelector": selector, "gracePeriodSeconds": grace})

    def pod_log(self, name: str, container: str, follow: bool = False) -> Any:
        """The log text (``""`` when there is none yet: a pod with no node gets 204 and no
        body), or with ``follow`` a response that streams it until the container ends."""
        answer = self.request("get", "pods/log", "GET", f"/pods/{name}/log",
                              {"container": container, "follow": follow or None}, stream=follow,
                              timeout=(self.timeout, None) if follow else None)
        if follow:
            return answer
        return answer if isinstance(answer, str) else ""

    def create_batch_job(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """A batch/v1 Job (``fiber run --durable``)."""
        return self.request("create", "jobs", "POST", "/jobs", None, body, api="/apis/batch/v1")

    def read_batch_job(self, name: str) -> dict[str, Any]:
        return self.request("get", "jobs", "GET", f"/jobs/{name}", api="/apis/batch/v1")

    def delete_batch_job(self, name: str) -> dict[str, Any]:
        """Delete the Job and, in the background, its pods."""
        return self.request("delete", "jobs", "DELETE", f"/jobs/{name}", {"propagationPolicy": "Background"},
                            api="/apis/batch/v1")

    def create_secret(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return self.request("create", "secrets", "POST", "/secrets", None, body)

    def delete_secret(self, name: str) -> dict[str, Any]:
        return self.request("delete", "secrets", "DELETE", f"/secrets/{name}")

    def own_pod(self) -> dict[str, Any] | None:
        """This process's pod, when it runs in one that the API lets it read; else ``None``.

        Found by ``POD_NAME`` (set on every pod Fiber creates) or the hostname, which a pod
        gets from its name.
        """
        if not in_pod():
            return None
        name = os.environ.get("POD_NAME") or socket.gethostname()
        try:
            pod = self.read_pod(name)
        except BackendError:
            return None
        return pod if isinstance(pod, dict) and pod.get("kind") == "Pod" else None

    def close(self) -> None:
        try:
            self.api.close()
        except Exception:
            pass


def api_status(e: Any) -> dict[str, Any]:
    """The ``Status`` object of an ``ApiException`` (``{}`` if its body is not one)."""
    try:
        body = json.loads(e.body or "{}")
        return body if isinstance(body, dict) else {}
    except (TypeError, ValueError):
        return {}


def http_status(e: BaseException) -> int | None:
    """The HTTP status of the API error behind a BackendError raised by :meth:`Cluster.call`."""
    return getattr(getattr(e, "cause", None), "status", None)


def api_error(e: Any, verb: str, resource: str, namespace: str) -> BackendError:
    """An ``ApiException`` as a BackendError that names what to fix."""
    status = api_status(e)
    message = status.get("message") or e.reason or str(e)
    if e.status == 403:
        return BackendError(
            f"Kubernetes refused to {verb} {resource} in namespace {namespace!r}: {message}. "
            f"The account lacks the '{verb}' verb on '{resource}': {RBAC_HINT}.", cause=e)
    if e.status == 401:
        return BackendError(
            f"Kubernetes rejected the credentials ({message}) when trying to {verb} {resource}: "
            "the token or certificate in the kubeconfig is missing or expired; refresh it "
            "(e.g. `gcloud container clusters get-credentials`, `aws eks update-kubeconfig`).", cause=e)
    if e.status == 404 and (status.get("details") or {}).get("kind") == "namespaces":
        return BackendError(
            f"namespace {namespace!r} does not exist: create it (`kubectl create namespace "
            f"{namespace}`) or set FIBER_KUBERNETES_NAMESPACE / [kubernetes] namespace.", cause=e)
    if e.status == 422:
        return BackendError(f"Kubernetes rejected the {resource} manifest: {message}", cause=e)
    return BackendError(f"Kubernetes API error on {verb} {resource} in namespace {namespace!r}: "
                        f"{e.status} {message}", cause=e)
