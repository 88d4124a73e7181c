"""fiber-docker: Fiber's ``docker`` backend, every job a container on a Docker Engine."""

from __future__ import annotations

__version__ = "0.1.0"
