"""HTTP front of the emulator: the core/v1 API subset, RBAC, watches, logs and admin endpoints."""

from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import json
import logging
import os
import random
import re
import select
import signal
import socket
import ssl
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from .dockerapi import Docker, DockerError
from .jobs import JobController, check_job, delete_job
from .kubelet import Kubelet, set_condition
from .store import (
    ApiError,
    Store,
    claim_metadata,
    default_config,
    not_found,
    now,
    parse_field_selector,
    parse_label_selector,
)
from .validation import (
    BadRequest,
    add_token_volume,
    default_pod,
    dns_label_errors,
    drop_empty,
    invalid_message,
    parse_quantity,
    qos_class,
    subdomain_errors,
    validate_pod,
)

log = logging.getLogger("k8s_emulator")
VERSION = {"major": "1", "minor": "30", "gitVersion": "v1.30.0-fiber-emulator", "gitCommit": "",
           "gitTreeState": "clean", "buildDate": "2024-01-01T00:00:00Z", "goVersion": "go1.22",
           "compiler": "gc", "platform": "linux/amd64"}
RESOURCES = [("pods", "Pod", True, ["create", "delete", "deletecollection", "get", "list", "watch"]),
             ("pods/eviction", "Eviction", True, ["create"]), ("pods/log", "Pod", True, ["get"]),
             ("pods/status", "Pod", True, ["get"]),
             ("secrets", "Secret", True, ["create", "delete", "get", "list"]),
             ("namespaces", "Namespace", False, ["create", "get", "list"]), ("nodes", "Node", False, ["get", "list"])]
PUBLIC = ("/version", "/healthz", "/livez", "/readyz")  # readable without credentials, as on a cluster
WATCH_MAX = 1800  # seconds a watch without timeoutSeconds stays open


def source_revision() -> str:
    """A digest of the emulator's source files: tests use a running emulator only if it serves
    the API of their own tree (``GET /_emulator/state`` says ``revision``)."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


class Emulator:
    """Store + kubelet + HTTP server. `start()` serves in a thread; `serve_forever()` in this one."""

    def __init__(self, config: dict[str, Any] | None = None, host: str = "127.0.0.1", port: int = 0,
                 docker_host: str | None = None, instance: str | None = None,
                 tls: tuple[str, str, str] | None = None) -> None:
        """``tls``: (certificate, key, CA certificate) files: serve HTTPS, and write the CA
        into the kubeconfig as ``certificate-authority-data``, as kind, GKE and EKS do."""
        cfg = default_config()
        cfg.update(config or {})
        self.store = Store(cfg)
        self.httpd = Server((host, port), Handler)
        self.httpd.emulator = self  # type: ignore[attr-defined]
        self.port = self.httpd.server_address[1]
        self.ca_data: str | None = None
        if tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(tls[0], tls[1])
            # The handshake happens in the request's thread, on its first read.
            self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True,
                                                do_handshake_on_connect=False)
            with open(tls[2], "rb") as f:
                self.ca_data = base64.b64encode(f.read()).decode()
        self.url = f"{'https' if tls else 'http'}://{host}:{self.port}"
        self.docker = Docker(docker_host) if docker_host else None
        self.kubelet = Kubelet(self.store, self.docker, instance or uuid.uuid4().hex[:12], self.port)
        self.jobs = JobController(self.store, admit_pod)
        self._thread: threading.Thread | None = None
        self.revision = source_revision()

    def start(self) -> Emulator:
        self.kubelet.start()
        self.jobs.start()
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="k8s-emulator", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.kubelet.start()
        self.jobs.start()
        try:
            self.httpd.serve_forever()
        finally:
            self.close()

    def shutdown(self) -> None:
        """Stop serving (from another thread); serve_forever then cleans up."""
        self.store.stopping = True
        with self.store.cond:
            self.store.cond.notify_all()
        threading.Thread(target=self.httpd.shutdown, daemon=True).start()

    def close(self) -> None:
        self.store.stopping = True
        with self.store.cond:
            self.store.cond.notify_all()
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(5)
        self.kubelet.stop()
        self.httpd.server_close()

    def kubeconfig(self, namespace: str = "default") -> str:
        token = self.store.config.get("token") or "fiber-emulator-token"
        ca = f"    certificate-authority-data: {self.ca_data}\n" if self.ca_data else ""
        return (f"apiVersion: v1\nkind: Config\nclusters:\n- name: fiber-emulator\n  cluster:\n"
                f"    server: {self.url}\n{ca}contexts:\n- name: fiber-emulator\n  context:\n"
                f"    cluster: fiber-emulator\n    namespace: {namespace}\n    user: fiber\n"
                f"current-context: fiber-emulator\nusers:\n- name: fiber\n  user:\n    token: {token}\n")

    def admin_state(self) -> dict[str, Any]:
        with self.store.cond:
            pods = [{"namespace": ns, "name": n, "uid": p["metadata"]["uid"], "phase": p["status"].get("phase"),
                     "nodeName": p["spec"].get("nodeName"), "deleting": "deletionTimestamp" in p["metadata"]}
                    for (ns, n), p in sorted(self.store.pods.items())]
            cfg, rv, nss = copy.deepcopy(self.store.config), self.store.rv, sorted(self.store.namespaces)
        containers = [{"id": c["Id"], "name": c["Names"][0].lstrip("/"), "image": c["Image"], "state": c["State"],
                       "pod": (c.get("Labels") or {}).get("io.kubernetes.pod.name"),
                       "namespace": (c.get("Labels") or {}).get("io.kubernetes.pod.namespace")}
                      for c in self.kubelet.containers()]
        reachable = bool(self.docker and self.docker.ping())
        return {"url": self.url, "instance": self.kubelet.instance, "revision": self.revision,
                "resourceVersion": rv, "namespaces": nss,
                "config": cfg, "pods": pods, "containers": containers,
                "docker": {"host": self.docker.host if self.docker else None, "reachable": reachable,
                           "images": self.docker.images() if self.docker and reachable else []}}

    def admin_config(self, patch: dict[str, Any]) -> dict[str, Any]:
        check_config(patch)
        for ns in patch.get("namespaces") or []:
            if ns not in self.store.namespaces:
                self.store.add_namespace(ns)
        with self.store.cond:
            self.store.config.update(copy.deepcopy(patch))
        self.store.wakeup.set()
        return copy.deepcopy(self.store.config)

    def admin_reset(self) -> dict[str, Any]:
        """Back to the start config; every pod is deleted at once (the kubelet removes containers)."""
        with self.store.cond:
            for (ns, name), pod in list(self.store.pods.items()):
                self.store.remove_pod(ns, name, pod["metadata"]["uid"])
            token = self.store.config.get("token")
            self.store.config = copy.deepcopy(self.store.initial_config)
            self.store.config["token"] = token
        self.store.wakeup.set()
        return copy.deepcopy(self.store.config)


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError, ssl.SSLError)):  # a client went away
            super().handle_error(request, client_address)


def check_config(cfg: dict[str, Any]) -> None:
    """Reject unknown keys and what would break the scheduler (nodes without name, bad quantities)."""
    unknown = set(cfg) - set(default_config())
    if unknown:
        raise ApiError(400, "BadRequest", f"unknown emulator config keys: {sorted(unknown)}")
    try:
        for n in cfg.get("nodes") or []:
            assert isinstance(n.get("name"), str) and n["name"], "every node needs a name"
            for q in (n.get("allocatable") or {}).values():
                parse_quantity(q)
        rbac = cfg.get("rbac")
        assert rbac is None or all(isinstance(v, list) for v in rbac.values()), "rbac: {resource: [verbs]} or null"
    except (AssertionError, AttributeError, BadRequest) as e:
        raise ApiError(400, "BadRequest", f"invalid emulator config: {e}") from None


def admit_pod(pod: Any, ns: str) -> dict[str, Any]:
    """A pod as the API server admits it (defaults, validation), or the error it answers with."""
    if not isinstance(pod, dict):
        raise ApiError(400, "BadRequest", "the body of the request was in an unknown format")
    if pod.get("kind", "Pod") != "Pod" or pod.get("apiVersion", "v1") != "v1":
        raise ApiError(400, "BadRequest", f'the API version in the data ({pod.get("apiVersion")}) does not match '
                       f'the expected API version (v1) or kind ({pod.get("kind")}) is not Pod')
    pod = drop_empty(copy.deepcopy(pod))  # what its JSON would leave out is not stored
    pod.update(kind="Pod", apiVersion="v1")
    meta = claim_metadata(pod, ns)
    meta.update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=now())
    for k in ("resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds", "selfLink"):
        meta.pop(k, None)
    try:
        default_pod(pod)
        add_token_volume(pod, "".join(random.choices("bcdfghjklmnpqrstvwxz2456789", k=5)))
        errs = validate_pod(pod)
    except BadRequest as e:
        raise ApiError(400, "BadRequest", f'Pod in version "v1" cannot be handled as a Pod: {e}') from None
    name = meta.get("name") or ""
    if errs:
        raise ApiError(422, "Invalid", invalid_message("Pod", name, errs),
                       {"name": name, "kind": "Pod", "causes": [e.cause() for e in errs]})
    if pod["spec"]["restartPolicy"] != "Never":
        rp = pod["spec"]["restartPolicy"]
        raise ApiError(422, "Invalid", f'Pod "{name}" is invalid: spec.restartPolicy: Unsupported value: '
                       f'"{rp}": supported values: "Never" (k8s emulator: the test kubelet never restarts '
                       'containers; set restartPolicy: Never)',
                       {"name": name, "kind": "Pod", "causes": [{"reason": "FieldValueNotSupported",
                                                                   "field": "spec.restartPolicy",
                                                                   "message": f'Unsupported value: "{rp}"'}]})
    pod["status"] = {"phase": "Pending", "qosClass": qos_class(pod)}
    return pod


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fiber-k8s-emulator"
    disable_nagle_algorithm = True

    @property
    def emu(self) -> Emulator:
        return self.server.emulator  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.info("%s %s", self.address_string(), format % args)

    # plumbing
    def _send(self, code: int, body: Any, ctype: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else (json.dumps(body) + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _start_chunked(self, ctype: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if readable and isinstance(self.connection, ssl.SSLSocket):
                return True  # a client sends nothing more on a watch: this is its close
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError as e:
            raise ApiError(400, "BadRequest", f"couldn't get version/kind; json parse error: {e}") from None

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        self.query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        try:
            body = self._body()
            if url.path.startswith("/_emulator/"):
                return self._admin(method, url.path, body)
            if url.path not in PUBLIC:
                self._authenticate()
            self._route(method, url.path.rstrip("/") or "/", body)
        except ApiError as e:
            self._send(e.code, e.status())
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as e:  # an emulator bug: still answer like a server would
            log.exception("internal error on %s %s", method, self.path)
            self._send(500, ApiError(500, "InternalError", f"Internal error occurred: {e!r}").status())

    def _authenticate(self) -> None:
        token = self.emu.store.config.get("token")
        if token and self.headers.get("Authorization") != f"Bearer {token}":
            raise ApiError(401, "Unauthorized", "Unauthorized")

    def _authorize(self, verb: str, resource: str, ns: str | None, name: str | None = None) -> None:
        cfg = self.emu.store.config
        rules = cfg.get("rbac")
        if rules is None or verb in (rules.get(resource) or []):
            return
        base, _, sub = resource.partition("/")
        what = f'{base} "{name}"' if name else base
        where = f'in the namespace "{ns}"' if ns else "at the cluster scope"
        details: dict[str, Any] = {"kind": base}
        if name:
            details["name"] = name
        raise ApiError(403, "Forbidden", f'{what} is forbidden: User "{cfg["user"]}" cannot {verb} resource '
                       f'"{resource}" in API group "" {where}', details)

    def _route(self, method: str, path: str, body: Any) -> None:
        q = self.query
        watching = q.get("watch") in ("true", "1")
        if method == "GET" and path in ("/healthz", "/livez", "/readyz"):
            return self._send(200, b"ok", "text/plain")
        if method == "GET" and path == "/version":
            return self._send(200, VERSION)
        if method == "GET" and path == "/api":
            return self._send(200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": f"127.0.0.1:{self.emu.port}"}]})
        if method == "GET" and path == "/apis":
            batch = {"groupVersion": "batch/v1", "version": "v1"}
            return self._send(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                {"name": "batch", "versions": [batch], "preferredVersion": batch}]})
        if method == "GET" and path == "/apis/batch/v1":
            return self._send(200, {"kind": "APIResourceList", "groupVersion": "batch/v1", "resources": [
                {"name": "jobs", "singularName": "job", "namespaced": True, "kind": "Job",
                 "verbs": ["create", "delete", "get", "list"]}]})
        m = re.fullmatch(r"/apis/batch/v1/namespaces/([^/]+)/jobs(?:/([^/]+))?", path)
        if m:
            return self._jobs(method, m[1], m[2], body)
        if method == "GET" and path == "/api/v1":
            return self._send(200, {"kind": "APIResourceList", "groupVersion": "v1", "resources": [
                {"name": n, "singularName": "" if "/" in n else n[:-1], "namespaced": nsd, "kind": k, "verbs": v,
                 **({"group": "policy", "version": "v1"} if k == "Eviction" else {})}
                for n, k, nsd, v in RESOURCES]})
        if path == "/api/v1/namespaces":
            if method == "GET":
                self._authorize("list", "namespaces", None)
                with self.emu.store.cond:
                    items = [copy.deepcopy(n) for _, n in sorted(self.emu.store.namespaces.items())]
                return self._send(200, {"kind": "NamespaceList", "apiVersion": "v1",
                                        "metadata": {"resourceVersion": str(self.emu.store.rv)}, "items": items})
            if method == "POST":
                self._authorize("create", "namespaces", None)
                name = ((body or {}).get("metadata") or {}).get("name") or ""
                errs = dns_label_errors("metadata.name", name) if name else []
                if errs:
                    raise ApiError(422, "Invalid", invalid_message("Namespace", name, errs),
                                   {"name": name, "kind": "Namespace", "causes": [e.cause() for e in errs]})
                labels = ((body or {}).get("metadata") or {}).get("labels")
                return self._send(201, self.emu.store.add_namespace(name, labels))
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)", path)
        if m and method == "GET":
            self._authorize("get", "namespaces", None, m[1])
            return self._send(200, self.emu.store.get_namespace(m[1]))
        if path == "/api/v1/nodes" and method == "GET":
            self._authorize("list", "nodes", None)
            return self._send(200, {"kind": "NodeList", "apiVersion": "v1",
                                    "metadata": {"resourceVersion": str(self.emu.store.rv)},
                                    "items": self.emu.store.nodes()})
        m = re.fullmatch(r"/api/v1/nodes/([^/]+)", path)
        if m and method == "GET":
            self._authorize("get", "nodes", None, m[1])
            for n in self.emu.store.nodes():
                if n["metadata"]["name"] == m[1]:
                    return self._send(200, n)
            raise not_found("nodes", m[1])
        m = re.fullmatch(r"/api/v1(?:/namespaces/([^/]+))?/pods", path)
        if m:
            ns = m[1]
            if method == "GET":
                self._authorize("watch" if watching else "list", "pods", ns)
                if ns is not None:
                    self.emu.store.get_namespace(ns)
                return self._watch(ns) if watching else self._list(ns)
            if method == "POST" and ns is not None:
                self._authorize("create", "pods", ns)
                return self._create(ns, body)
            if method == "DELETE" and ns is not None:
                self._authorize("deletecollection", "pods", ns)
                return self._delete_collection(ns, body)
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/secrets(?:/([^/]+))?", path)
        if m:
            return self._secrets(method, m[1], m[2], body)
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)(?:/(log|status|eviction))?", path)
        if m:
            ns, name, sub = m[1], m[2], m[3]
            if method == "POST" and sub == "eviction":
                self._authorize("create", "pods/eviction", ns, name)
                return self._evict(ns, name, body)
            if method == "GET" and sub != "eviction":
                self._authorize("get", f"pods/{sub}" if sub else "pods", ns, name)
                if sub == "log":
                    return self._log(ns, name)
                return self._send(200, self.emu.store.get_pod(ns, name))
            if method == "DELETE" and not sub:
                self._authorize("delete", "pods", ns, name)
                return self._send(200, self.emu.store.delete_pod(ns, name, self._grace(body)))
            if method in ("PUT", "PATCH"):
                raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested "
                               "resource (k8s emulator: pods cannot be updated)")
        if method not in ("GET", "POST", "DELETE") and path.startswith("/api/v1/"):
            raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")
        raise ApiError(404, "NotFound", "the server could not find the requested resource", {})

    # pods
    def _create(self, ns: str, pod: Any) -> None:
        pod = admit_pod(pod, ns)
        self._send(201, self.emu.store.create_pod(pod, dry_run=self.query.get("dryRun") == "All"))

    def _jobs(self, method: str, ns: str, name: str | None, body: Any) -> None:
        """batch/v1 Jobs: create, get, list, delete (no watch, no update); see jobs.py."""
        store = self.emu.store
        store.get_namespace(ns)
        if name is None and method == "GET":
            self._authorize("list", "jobs", ns)
            match = parse_label_selector(self.query.get("labelSelector"))
            with store.cond:
                items = [copy.deepcopy(j) for (jns, _), j in sorted(store.jobs.items())
                         if jns == ns and match(j["metadata"].get("labels") or {})]
            return self._send(200, {"kind": "JobList", "apiVersion": "batch/v1",
                                    "metadata": {"resourceVersion": str(store.rv)}, "items": items})
        if name is None and method == "POST":
            self._authorize("create", "jobs", ns)
            job = check_job(body, ns)
            with store.cond:
                key = (ns, job["metadata"]["name"])
                if key in store.jobs:
                    raise ApiError(409, "AlreadyExists", f'jobs.batch "{key[1]}" already exists',
                                   {"name": key[1], "group": "batch", "kind": "jobs"})
                if self.query.get("dryRun") != "All":
                    store.rv += 1
                    job["metadata"]["resourceVersion"] = str(store.rv)
                    store.jobs[key] = job
            return self._send(201, job)
        if name is not None and method == "GET":
            self._authorize("get", "jobs", ns, name)
            with store.cond:
                if (ns, name) not in store.jobs:
                    raise not_found("jobs.batch", name)
                return self._send(200, copy.deepcopy(store.jobs[(ns, name)]))
        if name is not None and method == "DELETE":
            self._authorize("delete", "jobs", ns, name)
            propagation = self.query.get("propagationPolicy") or (body or {}).get("propagationPolicy")
            return self._send(200, delete_job(store, ns, name, propagation))
        raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource "
                       "(k8s emulator: jobs are created, read, listed and deleted only)")

    def _secrets(self, method: str, ns: str, name: str | None, body: Any) -> None:
        """Secrets: create, get, list, delete (no watch, no update)."""
        store = self.emu.store
        if name is None and method == "GET":
            self._authorize("list", "secrets", ns)
            store.get_namespace(ns)
            items = store.list_secrets(ns, lambda s: parse_label_selector(self.query.get("labelSelector"))(
                s["metadata"].get("labels") or {}))
            return self._send(200, {"kind": "SecretList", "apiVersion": "v1",
                                    "metadata": {"resourceVersion": str(store.rv)}, "items": items})
        if name is None and method == "POST":
            self._authorize("create", "secrets", ns)
            return self._send(201, store.create_secret(self._new_secret(ns, body)))
        if name is not None and method == "GET":
            self._authorize("get", "secrets", ns, name)
            return self._send(200, store.get_secret(ns, name))
        if name is not None and method == "DELETE":
            self._authorize("delete", "secrets", ns, name)
            return self._send(200, store.delete_secret(ns, name))
        raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource "
                       "(k8s emulator: secrets are created, read, listed and deleted only)")

    def _new_secret(self, ns: str, secret: Any) -> dict[str, Any]:
        """A Secret as the API server stores it: stringData folded into base64 data, type Opaque."""
        if not isinstance(secret, dict) or secret.get("kind", "Secret") != "Secret":
            raise ApiError(400, "BadRequest", "the body of the request was not a Secret")
        secret = copy.deepcopy(secret)
        secret.update(kind="Secret", apiVersion="v1")
        meta = claim_metadata(secret, ns)
        name = meta.get("name") or ""
        errs = subdomain_errors("metadata.name", name)
        data = dict(secret.get("data") or {})
        for key, value in (secret.pop("stringData", None) or {}).items():
            data[key] = base64.b64encode(str(value).encode()).decode()
        for key, value in data.items():
            try:
                base64.b64decode(value, validate=True)
            except (ValueError, TypeError):
                raise ApiError(400, "BadRequest", f'Secret in version "v1" cannot be handled as a Secret: '
                               f"illegal base64 data in data.{key}") from None
        if errs:
            raise ApiError(422, "Invalid", invalid_message("Secret", name, errs),
                           {"name": name, "kind": "Secret", "causes": [e.cause() for e in errs]})
        meta.update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=now())
        secret["data"] = data
        secret.setdefault("type", "Opaque")
        return secret

    def _evict(self, ns: str, name: str, eviction: Any) -> None:
        """The Eviction subresource (policy/v1) as kube-apiserver >= 1.26 answers it, without
        PodDisruptionBudgets: the pod gets the ``DisruptionTarget`` condition, then is deleted
        gracefully (``deleteOptions.gracePeriodSeconds``, else the pod's own)."""
        if not isinstance(eviction, dict) or eviction.get("kind", "Eviction") != "Eviction":
            raise ApiError(400, "BadRequest", f"not a Eviction object: {type(eviction).__name__}")
        if (eviction.get("metadata") or {}).get("name") != name:
            raise ApiError(400, "BadRequest", "name in URL does not match name in Eviction object")
        options = eviction.get("deleteOptions") or {}
        store, uid = self.emu.store, self.emu.store.get_pod(ns, name)["metadata"]["uid"]
        if self.query.get("dryRun") != "All" and options.get("dryRun") != ["All"]:
            store.update_pod(ns, name, uid, lambda p: set_condition(
                p["status"], "DisruptionTarget", "True", "EvictionByEvictionAPI", "Eviction API: evicting"))
            store.delete_pod(ns, name, self._grace(options))
        self._send(201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201})

    def _matcher(self) -> Any:
        labels = parse_label_selector(self.query.get("labelSelector"))
        fields = parse_field_selector(self.query.get("fieldSelector"))
        return lambda p: labels(p["metadata"].get("labels") or {}) and fields(p)

    def _list(self, ns: str | None) -> None:
        items, rv = self.emu.store.list_pods(ns, self._matcher())
        self._send(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": str(rv)},
                         "items": items})

    def _watch(self, ns: str | None) -> None:
        store, match = self.emu.store, self._matcher()
        timeout = min(float(self.query.get("timeoutSeconds") or WATCH_MAX), WATCH_MAX)
        deadline = time.monotonic() + timeout
        rv_param = self.query.get("resourceVersion") or "0"
        try:
            last = int(rv_param)
        except ValueError:
            raise ApiError(400, "BadRequest", f'resourceVersion: Invalid value: "{rv_param}": must be a valid '
                           'resourceVersion') from None
        self._start_chunked("application/json")
        send = lambda kind, obj: self._chunk((json.dumps({"type": kind, "object": obj}) + "\n").encode())  # noqa: E731
        if last == 0:  # no resourceVersion: the current state as ADDED events, then the changes
            items, last = store.list_pods(ns, match)
            for pod in items:
                send("ADDED", pod)
        try:
            while not store.stopping:
                events = store.events_after(last)
                if events is None:
                    send("ERROR", ApiError(410, "Expired", f"too old resource version: {last} "
                                           f"({store.trimmed_rv})").status())
                    break
                for rv, kind, obj in events:
                    last = rv
                    if (ns is None or obj["metadata"]["namespace"] == ns) and match(obj):
                        send(kind, obj)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._client_gone():
                    break
                with store.cond:
                    if store.rv <= last and not store.stopping:
                        store.cond.wait(min(remaining, 1.0))
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True

    def _grace(self, body: Any) -> int | None:
        g = self.query.get("gracePeriodSeconds")
        if g is None and isinstance(body, dict):
            g = body.get("gracePeriodSeconds")
        if g is None or g == "":
            return None
        try:
            return max(0, int(g))
        except ValueError:
            raise ApiError(400, "BadRequest", f"invalid gracePeriodSeconds {g!r}") from None

    def _delete_collection(self, ns: str, body: Any) -> None:
        self.emu.store.get_namespace(ns)
        items, rv = self.emu.store.list_pods(ns, self._matcher())
        grace, deleted = self._grace(body), []
        for pod in items:
            try:
                deleted.append(self.emu.store.delete_pod(ns, pod["metadata"]["name"], grace))
            except ApiError:
                pass  # deleted meanwhile
        self._send(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": str(rv)},
                         "items": deleted})

    def _log(self, ns: str, name: str) -> None:
        pod = self.emu.store.get_pod(ns, name)
        names = [c["name"] for c in pod["spec"]["containers"]]
        cname = self.query.get("container")
        if not cname:
            if len(names) > 1:
                raise ApiError(400, "BadRequest", f"a container name must be specified for pod {name}, "
                               f"choose one of: [{' '.join(names)}]")
            cname = names[0]
        if cname not in names:
            raise ApiError(400, "BadRequest", f"container {cname} is not valid for pod {name}")
        if not pod["spec"].get("nodeName"):  # as kube-apiserver: no node, no log location
            self.send_response(204)
            self.end_headers()
            return
        if self.query.get("previous") in ("true", "1"):
            raise ApiError(400, "BadRequest", f'previous terminated container "{cname}" in pod "{name}" not found')
        cs = next((c for c in pod["status"].get("containerStatuses") or [] if c["name"] == cname), None)
        cid = ((cs or {}).get("containerID") or "").removeprefix("docker://")
        if not cid:
            waiting = ((cs or {}).get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason", "ContainerCreating")
            if reason in ("ErrImagePull", "ImagePullBackOff"):
                reason = "trying and failing to pull image"
            raise ApiError(400, "BadRequest", f'container "{cname}" in pod "{name}" is waiting to start: {reason}')
        q, docker = self.query, self.emu.docker
        tail = int(q["tailLines"]) if q.get("tailLines") else None
        since = int(time.time()) - int(q["sinceSeconds"]) if q.get("sinceSeconds") else None
        limit = int(q["limitBytes"]) if q.get("limitBytes") else None
        follow, stamps = q.get("follow") in ("true", "1"), q.get("timestamps") in ("true", "1")
        if docker is None:
            raise ApiError(500, "InternalError", "k8s emulator: no docker daemon configured")
        try:
            chunks = docker.logs(cid, follow=follow, tail=tail, timestamps=stamps, since=since)
            if not follow:
                data = b"".join(chunks)
                return self._send(200, data[:limit] if limit is not None else data, "text/plain")
            self._start_chunked("text/plain")
            sent = 0
            for chunk in chunks:
                if limit is not None:
                    chunk = chunk[: max(0, limit - sent)]
                if chunk:
                    self._chunk(chunk)
                    sent += len(chunk)
                if limit is not None and sent >= limit:
                    break
            self._chunk(b"")
            self.close_connection = True
        except DockerError as e:
            if e.status == 404:
                return self._send(200, b"", "text/plain")  # container already removed
            raise ApiError(500, "InternalError", f"k8s emulator: docker logs failed: {e.message}") from None

    # admin
    def _admin(self, method: str, path: str, body: Any) -> None:
        emu = self.emu
        if path == "/_emulator/state" and method == "GET":
            return self._send(200, emu.admin_state())
        if path == "/_emulator/config" and method == "GET":
            with emu.store.cond:
                return self._send(200, copy.deepcopy(emu.store.config))
        if path == "/_emulator/config" and method in ("PUT", "PATCH", "POST"):
            return self._send(200, emu.admin_config(body or {}))
        if path == "/_emulator/reset" and method == "POST":
            return self._send(200, emu.admin_reset())
        if path == "/_emulator/evict" and method == "POST":
            body = body or {}
            pod = emu.store.get_pod(body.get("namespace") or "default", body.get("name") or "")
            return self._send(200, emu.kubelet.evict(pod, body.get("resource") or "memory"))
        if path == "/_emulator/lose-node" and method == "POST":
            return self._send(200, emu.kubelet.lose_node((body or {}).get("name") or ""))
        if path == "/_emulator/kubeconfig" and method == "GET":
            return self._send(200, emu.kubeconfig().encode(), "application/yaml")
        raise ApiError(404, "NotFound", "unknown emulator admin endpoint; have GET /_emulator/state, GET|PUT "
                       "/_emulator/config, POST /_emulator/reset, POST /_emulator/evict, POST /_emulator/lose-node, "
                       "GET /_emulator/kubeconfig", {})


def load_config(value: str | None) -> dict[str, Any]:
    """JSON text or a path to a JSON file."""
    if not value:
        return {}
    text = value if value.lstrip().startswith("{") else open(value).read()
    return json.loads(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="k8s_emulator", description="Kubernetes API server emulator for fiber tests")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback only)")
    p.add_argument("--port", type=int, default=16443, help="0 picks a free port")
    p.add_argument("--docker-host", default=os.environ.get("DOCKER_HOST") or "unix://" + os.path.join(
        os.environ.get("FIBER_SERVICES_DIR", "/tmp/fiber-services"), "docker", "docker.sock"))
    p.add_argument("--config", default=os.environ.get("FIBER_K8S_EMULATOR_CONFIG"),
                   help="JSON text or file (also $FIBER_K8S_EMULATOR_CONFIG)")
    p.add_argument("--token", help="bearer token required from clients (default: accept any)")
    p.add_argument("--kubeconfig", help="write a kubeconfig for this server here once it listens")
    p.add_argument("--instance", default=None, help="label value of this emulator's containers")
    p.add_argument("--tls", nargs=3, metavar=("CERT", "KEY", "CA"),
                   help="serve HTTPS with this certificate and key; the kubeconfig embeds CA")
    p.add_argument("-v", "--verbose", action="store_true", help="log every request")
    a = p.parse_args(argv)
    if not a.host.startswith("127.") and a.host not in ("localhost", "::1"):
        p.error("the emulator listens on loopback only")
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(a.config)
        check_config(cfg)
    except (OSError, ValueError, ApiError) as e:
        p.error(f"--config: {e}")
    if a.token:
        cfg["token"] = a.token
    emu = Emulator(cfg, a.host, a.port, a.docker_host, a.instance, tuple(a.tls) if a.tls else None)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: emu.shutdown())
    if a.kubeconfig:
        tmp = a.kubeconfig + ".tmp"
        with open(tmp, "w") as f:
            f.write(emu.kubeconfig())
        os.replace(tmp, a.kubeconfig)
    print(f"k8s emulator listening on {emu.url} (docker {a.docker_host}, instance {emu.kubelet.instance})", flush=True)
    emu.serve_forever()
    return 0
