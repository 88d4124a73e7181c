"""Kubernetes API server emulator + test kubelet for fiber-k8s tests (never imported by the plugin)."""

from __future__ import annotations

from .server import Emulator, main

__all__ = ["Emulator", "main"]
