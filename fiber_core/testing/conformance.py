"""The one definition of what a backend must do, written once, run per backend.

Subclass :class:`BackendConformance` in a test module of your plugin and set
``backend_name`` (or override the ``backend`` fixture). Every test talks to the
real system the backend drives; nothing is mocked. A backend that truly cannot
support a check overrides that test with ``pytest.skip("why")``, so the reason
shows in the report.

The tests come in two kinds: *jobs* (the backend's own methods, on commands
that ``python -c`` runs) and *Fiber on the backend* (a Process, a Pipe, Queues,
a Pool that loses a worker, a Manager: what a program does with it). A job that
ends before it did what a test waits for fails that test at once, with the log
the backend kept of it (:meth:`~fiber_core.contract.backend.Backend.get_job_logs`):
a backend that cannot start its jobs fails in seconds, saying why, not after
``start_timeout``.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import queue
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

import fiber_core
from fiber_core.contract.backend import Backend, Job, JobSpec
from fiber_core.runtime.config import create_backend, listen_host, plugins
from fiber_core.runtime.run import runtime
from fiber_core.testing import targets

T = TypeVar("T")


class BackendConformance:
    """Behaviour every backend shares. Subclass it; pytest collects the subclass."""

    backend_name: str = "local"
    python: str = sys.executable
    """The interpreter inside jobs (``python3`` in an image)."""
    start_timeout: float = 60.0
    """Seconds a job may take to start and finish a trivial command (each wait's bound)."""
    targets_by_value: bool = True
    """Send the functions jobs run (:mod:`fiber_core.testing.targets`) by value, so that a
    job needs a working ``fiber_core`` but not this version of it. Code by value needs the
    jobs' Python to be this one's minor version: when it is not, set ``False``, and the
    jobs import the functions from their own ``fiber_core``, which must then be this one."""

    @pytest.fixture
    def backend(self) -> Iterator[Backend]:
        """A fresh backend instance; cleaned up after the test.

        Tests of Fiber on the backend ask for it too (they run on the process-wide
        instance): a plugin that overrides it to set up its service covers them all.
        """
        b = create_backend(self.backend_name, "conf" + secrets.token_hex(4))
        try:
            yield b
        finally:
            b.cleanup()

    # -- helpers ---------------------------------------------------------------------

    def spec(self, code: str, **kw: object) -> JobSpec:
        """A job running ``python -c code``."""
        kw.setdefault("name", "conformance")
        return JobSpec(command=[self.python, "-c", code], **kw)  # type: ignore[arg-type]

    def wait(self, backend: Backend, job: Job) -> int | None:
        return backend.wait_for_job(job, self.start_timeout)

    def log(self, backend: Backend, job: Job | None) -> str:
        """The job's log as the backend keeps it, for a failure message."""
        if job is None:
            return "\n(no job was started)"
        try:
            text = backend.get_job_logs(job)
        except Exception as e:
            text = f"(get_job_logs failed: {e!r})"
        return f"\n--- log of job {job.id} ({self.backend_name}) ---\n{text}"

    def wait_running(self, backend: Backend, job: Job, marker: str) -> None:
        """Wait until the job has printed ``marker`` (for a backend's own tests; the suite
        knows a job runs from :meth:`start_running`)."""
        deadline = time.monotonic() + self.start_timeout
        while marker not in backend.get_job_logs(job):
            code = backend.poll_job(job)
            if code is not None:
                pytest.fail(f"the job ended (exit code {code}) before it printed {marker!r}"
                            + self.log(backend, job))
            if time.monotonic() > deadline:
                pytest.fail(f"no {marker!r} from the job within start_timeout={self.start_timeout}s"
                            + self.log(backend, job))
            time.sleep(0.05)  # logs arrive without an event to wait for

    def start_running(self, backend: Backend, setup: str = "") -> Job:
        """Start a job that runs ``setup``, says it is running, then sleeps; return it once it
        said so. It says so by connecting to this process (an event, not its log, which some
        platforms publish only when a job ends); it also prints ``up``."""
        host = listen_host(backend)  # as Fiber does: the listen_host setting, else the backend
        with socket.create_server((host, 0)) as server:
            port = server.getsockname()[1]
            job = backend.start_job(self.spec(
                f"import socket, time; {setup or 'pass'}; "
                f"s = socket.create_connection(({host!r}, {port})); s.sendall(b'up'); "
                "print('up', flush=True); time.sleep(600)"))
            deadline = time.monotonic() + self.start_timeout
            step = 0.01
            while True:
                server.settimeout(step)
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    pass
                else:
                    conn.close()
                    return job
                code = backend.poll_job(job)
                if code is not None:
                    pytest.fail(f"the job ended (exit code {code}) before it was running"
                                + self.log(backend, job))
                if time.monotonic() > deadline:
                    pytest.fail(f"the job did not connect to {host}:{port} within "
                                f"start_timeout={self.start_timeout}s" + self.log(backend, job))
                step = min(step * 2, 0.25)

    def target(self, func: Callable[..., Any]) -> Callable[..., Any]:
        """``func`` as it is sent to jobs (by value unless :attr:`targets_by_value` is off)."""
        return _ByValue(func) if self.targets_by_value else func

    def process_log(self, p: fiber_core.Process) -> str:
        """The log of the job that runs ``p``, as its backend keeps it."""
        return self.log(runtime().get_backend(self.backend_name), p.job)

    def process(self, func: Callable[..., Any], *args: Any) -> fiber_core.Process:
        """A (not yet started) Fiber process on this backend running ``func(*args)``."""
        return fiber_core.Process(target=self.target(func), args=args, backend=self.backend_name)

    @contextlib.contextmanager
    def started(self, *procs: fiber_core.Process) -> Iterator[None]:
        """Start ``procs``; kill and join whichever still runs when the block ends."""
        try:
            for p in procs:
                p.start()
            yield
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                if p.job is not None:
                    p.join(self.start_timeout)

    def joined(self, p: fiber_core.Process) -> int | None:
        """Join ``p`` (at most ``start_timeout``) and return its exit code."""
        p.join(self.start_timeout)
        return p.exitcode

    def receive(self, p: fiber_core.Process, get: Callable[[float], T], what: str) -> T:
        """Wait for ``what`` from the job of ``p``; ``get(timeout)`` raises :class:`queue.Empty`
        when nothing came in time. Fails at once, with the job's log, when ``p`` ended
        without sending it."""
        deadline = time.monotonic() + self.start_timeout
        step = 0.01
        while True:
            try:
                return get(step)
            except queue.Empty:
                pass
            except (EOFError, OSError) as e:  # the job's end of the connection is gone
                p.join(self.start_timeout)
                pytest.fail(f"{p.name} ended (exit code {p.exitcode}) before it sent {what}: {e}"
                            + self.process_log(p))
            code = p.exitcode
            if code == 0:  # it sent everything before it exited: what is in flight arrives
                try:
                    return get(self.start_timeout)
                except queue.Empty:
                    pass
            if code is not None:
                pytest.fail(f"{p.name} ended (exit code {code}) before it sent {what}"
                            + self.process_log(p))
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} from {p.name} within start_timeout={self.start_timeout}s"
                            + self.process_log(p))
            step = min(step * 2, 0.25)

    # -- registration --------------------------------------------------------------

    def test_registered(self, backend: Backend) -> None:
        assert plugins().get_class(backend.name) is type(backend)
        for alias in type(backend).aliases:
            assert plugins().get_class(alias) is type(backend)

    # -- lifecycle and exit codes ---------------------------------------------------

    def test_exit_zero(self, backend: Backend) -> None:
        job = backend.start_job(self.spec("pass"))
        assert self.wait(backend, job) == 0, self.log(backend, job)
        assert backend.poll_job(job) == 0

    def test_exit_code(self, backend: Backend) -> None:
        job = backend.start_job(self.spec("import sys; sys.exit(7)"))
        assert self.wait(backend, job) == 7, self.log(backend, job)

    def test_poll_while_running(self, backend: Backend) -> None:
        job = self.start_running(backend)
        assert backend.poll_job(job) is None
        assert backend.wait_for_job(job, 0.2) is None
        backend.kill_job(job)
        assert self.wait(backend, job) is not None

    def test_terminate(self, backend: Backend) -> None:
        job = self.start_running(backend)
        backend.terminate_job(job)
        assert self.wait(backend, job) == -signal.SIGTERM, self.log(backend, job)

    def test_kill(self, backend: Backend) -> None:
        job = self.start_running(backend, "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)")
        backend.kill_job(job)
        code = self.wait(backend, job)
        default = type(backend).kill_job is Backend.kill_job
        assert code == -signal.SIGKILL, (
            f"exit code {code} after kill_job"
            + (": the default kill_job only terminates, override it" if default else "")
            + self.log(backend, job))

    def test_terminate_twice_and_after_exit(self, backend: Backend) -> None:
        job = self.start_running(backend)
        backend.terminate_job(job)
        backend.terminate_job(job)
        code = self.wait(backend, job)
        backend.terminate_job(job)
        backend.kill_job(job)
        assert backend.poll_job(job) == code

    # -- environment, logs, network --------------------------------------------------

    def test_env_and_logs(self, backend: Backend) -> None:
        token = secrets.token_hex(8)
        job = backend.start_job(self.spec(
            "import os, sys; print('out', os.environ['CONF_TOKEN']); "
            "print('err', os.environ['CONF_TOKEN'], file=sys.stderr)",
            env={"CONF_TOKEN": token}))
        assert self.wait(backend, job) == 0, self.log(backend, job)
        deadline = time.monotonic() + 10
        while True:  # some systems publish logs a moment after the job ends
            logs = backend.get_job_logs(job)
            if f"out {token}" in logs and f"err {token}" in logs or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        keep = "a backend keeps its jobs' output in job.state.log, or overrides get_job_logs"
        assert f"out {token}" in logs, f"stdout is missing from get_job_logs: {logs!r} ({keep})"
        assert f"err {token}" in logs, f"stderr is missing from get_job_logs: {logs!r} ({keep})"

    def test_job_reaches_listen_address(self, backend: Backend) -> None:
        host = listen_host(backend)  # as Fiber does: the listen_host setting, else the backend
        server = socket.create_server((host, 0))
        port = server.getsockname()[1]
        token = secrets.token_hex(8)
        got: list[bytes] = []

        def accept() -> None:
            server.settimeout(self.start_timeout)
            try:
                conn, _ = server.accept()
                got.append(conn.recv(100))
                conn.close()
            except OSError:
                pass

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        try:
            job = backend.start_job(self.spec(
                f"import socket; s = socket.create_connection(({host!r}, {port})); s.sendall(b'{token}')"))
            assert self.wait(backend, job) == 0, self.log(backend, job)
            t.join(self.start_timeout)
            assert got == [token.encode()]
        finally:
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_RDWR)  # wakes the accept() of a job that never came
            server.close()
            t.join(self.start_timeout)

    def test_labels_and_name_accepted(self, backend: Backend) -> None:
        spec = self.spec("pass", name="Process-1:2 weird/name",
                         labels={"fiber.run": backend.run_id or "r", "fiber.name": "Process-1:2"})
        job = backend.start_job(spec)
        assert self.wait(backend, job) == 0, self.log(backend, job)

    # -- cleanup ---------------------------------------------------------------------

    def test_cleanup_stops_running_jobs(self, backend: Backend) -> None:
        jobs = [self.start_running(backend) for _ in range(2)]
        backend.cleanup()
        for job in jobs:
            assert backend.wait_for_job(job, self.start_timeout) is not None
        assert backend.jobs == []

    # -- Fiber on this backend ---------------------------------------------------------

    def test_fiber_process_roundtrip(self, backend: Backend) -> None:
        q = fiber_core.Queue()
        p = self.process(targets.put_square, q, 12)
        with self.started(p):
            assert self.receive(p, functools.partial(q.get, True), "its result") == 144
            assert self.joined(p) == 0, self.process_log(p)

    def test_process_exit_codes(self, backend: Backend) -> None:
        procs = [self.process(targets.exit_with, code) for code in (0, 5)]
        with self.started(*procs):
            for p, code in zip(procs, (0, 5)):
                assert self.joined(p) == code, self.process_log(p)
                assert not p.is_alive()

    def test_process_kill(self, backend: Backend) -> None:
        q = fiber_core.Queue()
        p = self.process(targets.hold, q)
        with self.started(p):
            assert self.receive(p, functools.partial(q.get, True), '"up"') == "up"
            assert p.is_alive()
            p.kill()
            assert self.joined(p) == -signal.SIGKILL, self.process_log(p)

    def test_pipe_end_sent_to_a_job(self, backend: Backend) -> None:
        here, there = fiber_core.Pipe()
        p = self.process(targets.echo_doubles, there)

        def recv(timeout: float) -> Any:
            if here.poll(timeout):
                return here.recv()
            raise queue.Empty

        with self.started(p):
            assert self.receive(p, recv, "its name on the Pipe") == p.name
            for x in (1, 21, 512):
                here.send(x)
                assert self.receive(p, recv, f"the double of {x}") == 2 * x
            here.send(None)
            assert self.joined(p) == 0, self.process_log(p)

    def test_queues_both_ways(self, backend: Backend) -> None:
        inbox, outbox = fiber_core.Queue(), fiber_core.Queue()
        p = self.process(targets.echo_squares, inbox, outbox)
        with self.started(p):
            for x in range(5):
                inbox.put(x)
            got = [self.receive(p, functools.partial(outbox.get, True), f"square {i}") for i in range(5)]
            assert got == [x * x for x in range(5)]
            inbox.put(None)
            assert self.joined(p) == 0, self.process_log(p)

    def test_pool_survives_a_lost_worker(self, backend: Backend) -> None:
        items = list(range(12))
        with fiber_core.Pool(2, backend=self.backend_name) as pool:
            it = pool.imap(self.target(targets.slow_square), items, chunksize=1)
            first = it.next(self.start_timeout)
            # The worker that sent it is busy with the next tasks: lose it, as the OOM
            # killer or a lost node would (not through Fiber's own stop).
            victim = next(p for p in pool._pool if p.name == first[1])  # noqa: SLF001 - the stdlib Pool's list of workers, which its own tests read too
            assert victim.job is not None
            runtime().get_backend(self.backend_name).kill_job(victim.job)
            results = [first] + [it.next(self.start_timeout) for _ in items[1:]]
            assert [r for r, _ in results] == [x * x for x in items]  # every result, once, in order
            with pytest.raises(StopIteration):
                it.next(self.start_timeout)
            assert self.joined(victim) == -signal.SIGKILL, self.process_log(victim)

    def test_manager_dict_from_a_job(self, backend: Backend) -> None:
        with fiber_core.Manager(backend=self.backend_name) as manager:
            d = manager.dict()
            d["parent"] = 21
            p = self.process(targets.double_entry, d, "parent")
            with self.started(p):
                assert self.joined(p) == 0, self.process_log(p)
            assert d.copy() == {"parent": 21, "job": 42}


class _ByValue:
    """A function that pickles by value: a job unpickles it without importing its module."""

    _lock = threading.Lock()

    def __init__(self, func: Callable[..., Any]) -> None:
        import cloudpickle  # a dependency of fiber-core, loaded by Fiber on demand too

        module = sys.modules[func.__module__]
        with self._lock:  # cloudpickle's registry is process-wide
            registered = module.__name__ in cloudpickle.list_registry_pickle_by_value()
            if not registered:
                cloudpickle.register_pickle_by_value(module)
            try:
                self._blob = cloudpickle.dumps(func, protocol=pickle.HIGHEST_PROTOCOL)
            finally:
                if not registered:
                    cloudpickle.unregister_pickle_by_value(module)
        self._func = func
        functools.update_wrapper(self, func)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._func(*args, **kwargs)

    def __reduce__(self) -> tuple[Callable[[bytes], Any], tuple[bytes]]:
        return pickle.loads, (self._blob,)
