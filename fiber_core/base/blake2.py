"""hashlib's BLAKE2b without importing hashlib, whose import loads OpenSSL (2 ms of every job's start)."""

from __future__ import annotations

try:
    from _blake2 import blake2b  # the module hashlib.blake2b comes from
except ImportError:  # a Python built without its own BLAKE2: hashlib has OpenSSL's
    from hashlib import blake2b

__all__ = ["blake2b"]
