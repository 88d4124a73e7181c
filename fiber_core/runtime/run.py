"""Per-process state of a Fiber program: run id, key, listener, backend, children.

The first process of a program (the one the user started) creates the run: a
random run id and a random 32-byte key. Jobs inherit both through their
environment, so every process of the run can authenticate to every other.

Exit: :meth:`Runtime.shutdown` waits for the non-daemon children, stops the
others and cleans up the backends. It runs after the program's non-daemon
threads are joined (as multiprocessing does) and before every ``atexit``
handler, so that no SDK's own exit handler (the kubernetes client deleting its
temporary CA file, paramiko closing its connections) has torn down what the
cleanup needs. SIGTERM to the program's first process, when the program has no
handler of its own, runs the same cleanup, then ends the process by the signal.
"""

from __future__ import annotations

import atexit
import multiprocessing.process
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

from fiber_core.base import rundirs
from fiber_core.base.errors import ConfigError, FiberError
from fiber_core.base.fds import raise_limit
from fiber_core.base.log import log
from fiber_core.contract.env import ENV_AUTHKEY, ENV_GROUP, ENV_PARENT_RUNDIR, ENV_RUN_ID, ENV_TOKEN
from fiber_core.runtime.config import (
    config,
    create_backend,
    likely_local_settings,
    listen_host,
    plugins,
    selected_backend_name,
)
from fiber_core.runtime.hub import Hub

TYPE_CHECKING = False  # typing's own, without importing typing: a job starts without it
if TYPE_CHECKING:
    from fiber_core.contract.backend import Backend
    from fiber_core.runtime.status import StatusServer



class Runtime:
    """Everything one process of a run knows: created on first use."""

    def __init__(self) -> None:
        self.run_id = os.environ.get(ENV_RUN_ID) or os.urandom(16).hex()[:12]
        self.started = time.time()
        # A few descriptors per job: the common soft limit of 1,024 would cap the run.
        self.fd_limits = raise_limit()
        """The soft limit on open descriptors before and after this process raised it."""
        key = os.environ.get(ENV_AUTHKEY)
        self.authkey = bytes.fromhex(key) if key else os.urandom(32)
        self.is_worker = ENV_TOKEN in os.environ or ENV_GROUP in os.environ
        # Proxies of the stdlib's managers authenticate with this process's authkey.
        multiprocessing.process.current_process().authkey = self.authkey
        self._lock = threading.RLock()
        self._hub: Hub | None = None
        self._status: StatusServer | None = None
        self._backends: dict[str, tuple[tuple[int, tuple[str, ...]], Backend]] = {}
        self._all_backends: list[Backend] = []
        self._rundir: str | None = None
        self.children: set = set()
        self.counter = 0
        self._selected: tuple[tuple[int, tuple[str, ...]], Backend] | None = None
        self._shutdown_steps: list[Callable[[], None]] = []
        self._shut_down = False
        self.terminating = False
        """SIGTERM ended the program: its children are stopped at exit, not waited for."""
        self._sigterm_installed = False
        self._exiting = False
        atexit.register(self.shutdown)
        # A child forked from this process by other code (multiprocessing with fork) is not
        # part of the run: its exit or SIGTERM must not stop this process's jobs or files.
        os.register_at_fork(after_in_child=self._forked)
        try:
            # Runs before the interpreter joins the non-daemon threads and before atexit.
            getattr(threading, "_register_atexit", lambda f: None)(self._before_exit)
        except RuntimeError:  # created while the interpreter already shuts down
            pass

    @property
    def exiting(self) -> bool:
        """The exit sequence has begun: nothing new should be started from here on."""
        return self._exiting

    def at_shutdown(self, step: Callable[[], None]) -> None:
        """Run ``step`` at exit before the backends clean up (the layers above add theirs)."""
        if step not in self._shutdown_steps:
            self._shutdown_steps.append(step)

    @property
    def rundir(self) -> str:
        """This process's private directory for the run's files, made on first use.

        Inside the parent's run directory when this is a job on the parent's machine (the
        parent's exit removes it with its own); else in the temp dir, locked while this
        process lives, after removing the run directories there whose creator has died.
        Removed at exit (:meth:`shutdown`).
        """
        with self._lock:
            if self._rundir is None:
                inside = rundirs.usable(os.environ.get(ENV_PARENT_RUNDIR))
                if inside is None:
                    for path in rundirs.remove_stale():
                        log.debug("fiber: removed %s, left by a run that has ended", path)
                # Short inside the parent's, whose name says the run: the hub's socket path
                # must fit a Unix socket's 107 bytes however deep jobs nest.
                prefix = "job-" if inside else f"{rundirs.PREFIX}{self.run_id}-"
                self._rundir = rundirs.make(prefix, inside)
                self.handle_sigterm()
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
            canonical = self._select()
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
                self.handle_sigterm()
                if name is None and not self.is_worker:
                    backend.warm_up()
            if name is None:
                self._selected = (version, backend)
            return backend

    def expect_jobs(self) -> None:
        """The program made an object for its jobs (a lock, a shared value): in its first
        process, choose the backend now, so that what it prepares for jobs (the local
        template) starts meanwhile, as :mod:`multiprocessing` starts its resource tracker
        there. A bad backend setting is not reported here but where a job starts."""
        if self.is_worker or self._selected is not None:
            return
        try:
            self.get_backend(None)
        except FiberError:
            pass

    def _select(self) -> str:
        """The configured backend's name (:func:`selected_backend_name`). Before the run's
        first backend is made, where it will likely be the local one (nothing chosen, or
        ``local``), the local template starts first: it imports while this process loads the
        plugins that could still choose another (and then it is closed, unused)."""
        settings = None if self.is_worker or self._backends else likely_local_settings()
        if settings is None:
            return selected_backend_name()
        from fiber_core.backends import early  # loaded by likely_local_settings

        early.start_template_early(settings)
        canonical = ""
        try:
            canonical = selected_backend_name()
            return canonical
        finally:
            if canonical != early.SECTION:
                early.discard_early_template()

    @property
    def hub(self) -> Hub:
        with self._lock:
            if self._hub is None:
                host = listen_host(self.backend)
                self._hub = Hub(self.authkey, host, config.get("listen_port"), self.rundir)
                self.status_from_config()
            return self._hub

    def status_from_config(self) -> None:
        """Show the run's state if the settings ask (``status``, ``status_port``): in the
        program's first process only, once it has a hub (or is given one by ``init()``).
        A page whose port is taken is a warning: the program's work goes on."""
        if self.is_worker or self._hub is None or self._shut_down:
            return
        port = config.get("status_port")
        if not config.get("status") and port is None:
            return
        try:
            self.serve_status(page=port is not None, port=port or 0)
        except FiberError as e:
            log.warning("fiber: %s", e)

    def serve_status(self, page: bool = False, port: int = 0) -> StatusServer:
        """Show this process's state to ``fiber top`` (and, with ``page``, on a page on
        127.0.0.1:``port``); see :mod:`fiber_core.runtime.status`. Idempotent."""
        # Loaded only when asked: a job's start does not pay for it.
        from fiber_core.runtime.status import StatusServer, announce, bind_error

        with self._lock:
            if self._shut_down:
                raise FiberError("the run has ended: its state is no longer shown")
            if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
                raise ConfigError(f"the status page's port must be an int from 0 to 65535, not {port!r}")
            first = self._status is None
            if first:
                run = {"id": self.run_id, "pid": os.getpid(), "started": self.started,
                       "program": os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python",
                       "host": socket.gethostname()}
                self._status = StatusServer(self.hub, self.authkey, self.rundir, run, self._status_state)
            status = self._status
            assert status is not None
            if first:
                announce(f"run {self.run_id} shows its state: fiber top {self.run_id}")
            if page and status.url is None:
                try:
                    url = status.serve_page(port)
                except OSError as e:
                    raise bind_error(port, e) from e
                announce(f"status page of run {self.run_id}: {url}")
            return status

    def _status_state(self) -> dict:
        from fiber_core.runtime.status import snapshot

        selected = self._selected
        run = {**(self._status.run if self._status is not None else {}),
               "backend": selected[1].name if selected is not None else None}
        return snapshot(run, list(self.children))

    def addresses_for(self, backend: Backend) -> str:
        """This process's addresses as seen by jobs of ``backend``."""
        return self.hub.addresses_for(listen_host(backend))

    def next_identity(self) -> int:
        with self._lock:
            self.counter += 1
            return self.counter

    def handle_sigterm(self) -> None:
        """Make SIGTERM run the exit sequence (once a run has something to clean up).

        Only in the program's first process, from its main thread, and only while SIGTERM
        has its default action: a program's own handler is left alone. The handler raises
        ``SystemExit`` in the main thread, so ``finally`` blocks run and locks are released;
        the exit then stops the children instead of waiting for them, cleans up, and ends
        the process by SIGTERM (the status a shell reports as 143). SIGTERM that arrives
        while the exit already runs stops the children it waits for.
        """
        if (self._sigterm_installed or self.is_worker
                or threading.current_thread() is not threading.main_thread()):
            return
        self._sigterm_installed = True
        try:
            if signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
                return
            signal.signal(signal.SIGTERM, self._on_sigterm)
        except (ValueError, OSError):  # not the main interpreter
            pass

    def _forked(self) -> None:
        self._shut_down = True  # nothing of the run is this process's to clean up
        if self._sigterm_installed:
            try:
                if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
            except (ValueError, OSError):
                pass

    def _on_sigterm(self, signum: int, frame: object) -> None:
        first = not self.terminating
        self.terminating = True
        if self._exiting:  # waiting for children at exit: stop them (not here: locks may be held)
            threading.Thread(target=self._stop_children, daemon=True, name="fiber-sigterm").start()
        elif first:
            raise SystemExit(128 + signum)

    def _stop_children(self) -> None:
        for child in list(self.children):
            try:
                child.terminate()
            except Exception:
                log.exception("fiber: could not stop %s", child)

    def _before_exit(self) -> None:
        """threading's exit hook: before the non-daemon threads are joined and before atexit.

        After SIGTERM: the exit sequence now (threads of the program are not waited for,
        as the signal's default action would not), then the process ends by the signal.
        Else :meth:`shutdown` moves to the front of the atexit handlers, ahead of those that
        SDKs registered after this process started (LIFO order): it runs once the program's
        threads are joined, while files and connections of the SDKs still exist.
        """
        if self.terminating:
            self.shutdown()  # ends the process
            return
        atexit.unregister(self.shutdown)
        atexit.register(self.shutdown)

    def _die_by_sigterm(self) -> None:
        """End the process as SIGTERM's default action would have, once the other exit
        handlers ran (an SDK's temporary files go) and the output is flushed."""
        try:
            atexit._run_exitfuncs()  # this one's is done: it returns at once  # noqa: SLF001 - atexit offers no public way to run the handlers now
        except Exception:
            pass
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except Exception:
                pass
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
        except (ValueError, OSError):
            return  # not the main thread: the SystemExit status (143) stands
        os.kill(os.getpid(), signal.SIGTERM)

    def shutdown(self) -> None:
        """At exit: the steps added by :meth:`at_shutdown` (waiting for the non-daemon
        children and stopping the others, as multiprocessing does), then release backend
        resources. Runs once."""
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
        self._exiting = True
        try:
            for step in self._shutdown_steps:
                step()
        finally:
            for backend in list(self._all_backends):
                try:
                    backend.cleanup()
                except Exception:
                    log.exception("fiber: cleanup of backend %s failed", backend.name)
            early = sys.modules.get("fiber_core.backends.early")
            if early is not None:  # a template started early that no backend took
                early.discard_early_template()
            if self._status is not None:
                self._status.close()
            if self._hub is not None:
                self._hub.close()
            if self._rundir is not None:
                rundirs.remove(self._rundir)
            if self.terminating:
                self._die_by_sigterm()


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
