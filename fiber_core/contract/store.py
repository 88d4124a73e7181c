"""Object storage for a durable run's journal, as a plugin provides it (``fiber_journal_store``).

A journal on a directory needs nothing from a plugin. One in object storage (``journal =
s3://bucket/prefix``) is written through an :class:`ObjectStore`: whole objects with
conditional writes, which is all the journal asks (its records go in append-only segments,
its lease is an object written only if absent or unchanged).
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class ObjectStore(ABC):
    """A flat namespace of objects under one prefix, with conditional writes.

    Each method is one request to the storage: an object is written whole or not at all.
    Errors of the storage (unreachable, refused) are raised as :class:`OSError`.
    """

    where: str = ""
    """The store as messages name it: ``s3://bucket/prefix``."""

    @abstractmethod
    def get(self, name: str) -> tuple[bytes, str] | None:
        """The object ``name`` and its version tag (an ETag), or None if there is none."""

    @abstractmethod
    def put(self, name: str, data: bytes, *, if_absent: bool = False,
            if_tag: str | None = None) -> str | None:
        """Write the object ``name``: with ``if_absent`` only if there is none, with ``if_tag``
        only if its tag is still that one. Its new tag, or None where the condition failed."""

    @abstractmethod
    def delete(self, name: str, *, if_tag: str | None = None) -> bool:
        """Remove the object ``name`` (with ``if_tag``: only that version of it); False where the
        condition failed. Removing an object that is not there succeeds."""

    @abstractmethod
    def names(self, prefix: str = "") -> list[str]:
        """The names of the objects under ``prefix`` (relative to the store's own prefix)."""
