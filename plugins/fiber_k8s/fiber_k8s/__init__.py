"""fiber-k8s: Fiber's ``kubernetes`` backend (every job a pod) and the ``fiber run`` command.

``FIBER_BACKEND=kubernetes python app.py`` inside a cluster (selected by itself in a pod),
or ``fiber run python app.py`` from a laptop.
"""

from __future__ import annotations

from fiber_k8s.backend import KubernetesBackend

__version__ = "0.1.0"
__all__ = ["KubernetesBackend"]
