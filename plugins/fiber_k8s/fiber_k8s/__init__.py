"""fiber-k8s: Fiber's ``kubernetes`` backend (every job a pod) and the ``fiber run`` command.

``FIBER_BACKEND=kubernetes python app.py`` inside a cluster (selected by itself in a pod),
or ``fiber run python app.py`` from a laptop.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["KubernetesBackend"]


def __getattr__(name: str) -> Any:
    # On first use: detecting a pod (fiber_k8s.plugin) must not load the backend and its SDK.
    if name == "KubernetesBackend":
        from fiber_k8s.backend import KubernetesBackend

        return KubernetesBackend
    raise AttributeError(f"module 'fiber_k8s' has no attribute {name!r}")
