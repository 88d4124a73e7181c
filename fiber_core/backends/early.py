"""The local template started before the run's backend is chosen, and the local backend's options it reads.

While a program chooses its backend (it loads the plugins, one of which could still choose
another), the local template starts and imports. This module holds it until the local backend
made for the run takes it (:func:`adopt`), or closes it (:func:`discard_early_template`). It
imports no part of the backend contract, pluggy or the local backend: the template starts
before the program imports them.
"""

from __future__ import annotations

import os
import sys
import threading

from fiber_core.backends.template import Template, TemplateError
from fiber_core.base.options import Option
from fiber_core.contract.env import ENV_PARENT_PID

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any

SECTION = "local"
"""The local backend's name, and the section of its settings."""

OPTIONS = (
    Option("start", str, "template", "how worker jobs start: forked from a template process with "
           "Fiber imported (template), or as a new interpreter each (fresh)", choices=("template", "fresh")),
    Option("preload", list, [], "modules the template imports before it forks (set_forkserver_preload)"),
)
"""The local backend's options (``LocalBackend.options``)."""


def template_env() -> dict[str, str]:
    """A template's environment: this process's, and its pid, so that the template dies with it."""
    return {**os.environ, ENV_PARENT_PID: str(os.getpid())}


class _EarlyTemplate:
    """A template started before the run's backend is chosen (:func:`start_template_early`),
    until the local backend made for the run takes it or it is closed unused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: tuple[list[str], Template] | None = None

    def start(self, preload: list[str]) -> None:
        with self._lock:
            if self._held is None:
                try:
                    self._held = (preload, Template(sys.executable, template_env(), preload, lambda why: None))
                except TemplateError:
                    pass  # the backend, once made, starts its own and says why it cannot

    def adopt(self, preload: list[str], on_lost: Callable[[str], None]) -> Template | None:
        with self._lock:
            held, self._held = self._held, None
            if held is not None and held[0] == preload:
                held[1].on_lost = on_lost
                return held[1]
        if held is not None:
            held[1].close(timeout=0)  # it has no jobs: it need not be waited for
        return None

    def discard(self) -> None:
        with self._lock:
            held, self._held = self._held, None
        if held is not None:
            held[1].close(timeout=0)  # it has no jobs: it need not be waited for


_early = _EarlyTemplate()


def start_template_early(settings: Mapping[str, Any]) -> None:
    """Start the template now, with the local backend's ``settings``, for a local backend of
    this run made later (its ``warm_up`` takes it): while the program chooses its backend and
    imports the Pool, the template imports too. Nothing happens where workers start as new
    interpreters. :func:`discard_early_template` closes it if the run chose another backend
    after all."""
    if settings.get("start", "template") == "template":
        _early.start(list(settings.get("preload") or []))


def adopt(preload: list[str], on_lost: Callable[[str], None]) -> Template | None:
    """The template started early, if it preloads ``preload``; its losses go to ``on_lost``
    from now on. One started with other settings is closed (they changed meanwhile)."""
    return _early.adopt(preload, on_lost)


def discard_early_template() -> None:
    """Close the template :func:`start_template_early` started, if no backend took it."""
    _early.discard()
