"""fiber-ssh: Fiber jobs as processes on a list of SSH hosts (``FIBER_BACKEND=ssh``)."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
