"""Per-process state of a Fiber program: run id, key, listener, backend, children.

The first process of a program (the one the user started) creates the run: a
random run id and a random 32-byte key. Jobs inherit both through their
environment, so every process of the run can authenticate to every other.
"""

from __future__ import annotations

import atexit
import multiprocessing.process
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from fiber_core.base.log import log
from fiber_core.contract.env import ENV_AUTHKEY, ENV_RUN_ID, ENV_TOKEN
from fiber_core.runtime.config import (
    config,
    create_backend,
    listen_host,
    plugins,
    selected_backend_name,
)
from fiber_core.runtime.hub import Hub

if TYPE_CHECKING:
    from fiber_core.contract.backend import Backend



class Runtime:
    """Everything one process of a run knows: created on first use."""

    def __init__(self) -> None:
        self.run_id = os.environ.get(ENV_RUN_ID) or os.urandom(16).hex()[:12]
        key = os.environ.get(ENV_AUTHKEY)
        self.authkey = bytes.fromhex(key) if key else os.urandom(32)
        self.is_worker = ENV_TOKEN in os.environ
        # Proxies of the stdlib's managers authenticate with this process's authkey.
        multiprocessing.process.current_process().authkey = self.authkey
        self._lock = threading.RLock()
        self._hub: Hub | None = None
        self._backends: dict[str, tuple[tuple[int, tuple[str, ...]], Backend]] = {}
        self._all_backends: list[Backend] = []
        self._rundir: str | None = None
        self.children: set = set()
        self.counter = 0
        self._selected: tuple[tuple[int, tuple[str, ...]], Backend] | None = None
        self._shutdown_steps: list[Callable[[], None]] = []
        atexit.register(self.shutdown)

    def at_shutdown(self, step: Callable[[], None]) -> None:
        """Run ``step`` at exit before the backends clean up (the layers above add theirs)."""
        if step not in self._shutdown_steps:
            self._shutdown_steps.append(step)

    @property
    def rundir(self) -> str:
        with self._lock:
            if self._rundir is None:
                import tempfile  # on first use: a job that serves nothing starts without it

                self._rundir = tempfile.mkdtemp(prefix=f"fiber-{self.run_id}-")
                os.chmod(self._rundir, 0o700)
            return self._rundir

    @property
    def backend(self) -> Backend:
        """The configured backend (re-read each time, so a later ``init(backend=...)`` applies)."""
        return self.get_backend(None)

    def get_backend(self, name: str | None) -> Backend:
        """The backend for ``name`` (``None``: the configured one).

        Resolved once and reused while the configuration stays the same: a new
        instance (with the settings then in force) after ``init()`` or a change to a
        ``FIBER_*`` environment variable. Every instance made is cleaned up at exit.
        """
        version = (config.generation, _fiber_environment())
        if name is None:
            selected = self._selected
            if selected is not None and selected[0] == version:
                return selected[1]
            canonical = selected_backend_name()
        else:
            canonical = plugins().canonical(name)
        with self._lock:
            made = self._backends.get(canonical)
            if made is not None and made[0] == version:
                backend = made[1]
            else:
                backend = create_backend(canonical, self.run_id, self.rundir)
                self._backends[canonical] = (version, backend)
                self._all_backends.append(backend)
            if name is None:
                self._selected = (version, backend)
            return backend

    @property
    def hub(self) -> Hub:
        with self._lock:
            if self._hub is None:
                host = listen_host(self.backend)
                self._hub = Hub(self.authkey, host, config.get("listen_port"), self.rundir)
            return self._hub

    def addresses_for(self, backend: Backend) -> str:
        """This process's addresses as seen by jobs of ``backend``."""
        return self.hub.addresses_for(listen_host(backend))

    def next_identity(self) -> int:
        with self._lock:
            self.counter += 1
            return self.counter

    def shutdown(self) -> None:
        """At exit: the steps added by :meth:`at_shutdown` (stopping children as
        multiprocessing does), then release backend resources."""
        try:
            for step in self._shutdown_steps:
                step()
        finally:
            for backend in list(self._all_backends):
                try:
                    backend.cleanup()
                except Exception:
                    log.exception("fiber: cleanup of backend %s failed", backend.name)
            if self._hub is not None:
                self._hub.close()
            if self._rundir is not None:
                import shutil  # at exit, and only if there is a run directory

                shutil.rmtree(self._rundir, ignore_errors=True)


_runtime: Runtime | None = None


_runtime_lock = threading.Lock()


_sending = threading.local()


class sending_to:  # noqa: N801 - used as a context manager
    """While objects are pickled for a job, the addresses that job reaches this process at.

    Queues and Pipe ends owned by this process put these addresses in their pickle,
    so a job of any backend can dial back.
    """

    def __init__(self, addresses: str) -> None:
        self.addresses = addresses

    def __enter__(self) -> None:
        self.previous = getattr(_sending, "addresses", None)
        _sending.addresses = self.addresses

    def __exit__(self, *exc: object) -> None:
        _sending.addresses = self.previous


def outgoing_addresses(default: str) -> str:
    """The addresses to embed when pickling an object this process serves (see sending_to)."""
    return getattr(_sending, "addresses", None) or default


def runtime() -> Runtime:
    global _runtime
    if _runtime is None:
        with _runtime_lock:
            if _runtime is None:
                _runtime = Runtime()
    return _runtime


def _fiber_environment() -> tuple[str, ...]:
    """The ``FIBER_*`` variables of this process, ``KEY=VALUE``: part of what a backend's
    settings were resolved from."""
    return tuple(sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("FIBER_")))
