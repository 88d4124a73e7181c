"""Registers the ``kubernetes`` backend (alias ``k8s``) and the ``fiber run`` command, and
selects the backend inside a pod when nothing else is configured."""

from __future__ import annotations

from typing import Any

from fiber_core.contract import hookimpl

from fiber_k8s.cluster import in_pod


@hookimpl
def fiber_register_backends(register: Any) -> None:
    # Imported here: a program only asking which backend to use (detection) never loads it.
    from fiber_k8s.backend import KubernetesBackend

    register(KubernetesBackend)


@hookimpl
def fiber_detect_backend() -> str | None:
    """``kubernetes`` in a pod (the kubelet sets ``KUBERNETES_SERVICE_HOST``), else no opinion."""
    return "kubernetes" if in_pod() else None


@hookimpl
def fiber_run_launchers() -> dict[str, Any]:
    from fiber_k8s.run import add_options

    return {"kubernetes": add_options}
