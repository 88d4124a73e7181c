"""The ``docker`` backend: every Fiber job is a container on a Docker Engine.

How a job starts, whole: :meth:`DockerBackend.create_job` checks the image once (it
must run ``python3 -c "import fiber_core"``), creates a container from it with the
job's command, environment, labels, mounts and limits, and returns; a thread attaches
to the container's output and starts it (several start at once; the first container
of a backend starts before create_job returns). Containers run with host networking, ``--init`` (so the worker is not PID 1 and
SIGTERM ends it with -15) and ``--rm``: the daemon removes a container as soon as it
exits, so a run leaves nothing behind even when its parent is killed (the workers
end themselves when their parent's connection drops).

One thread per backend follows the daemon's event stream (``die`` events of this
backend's containers carry the exit code), so :meth:`~DockerBackend.poll_job` never
calls the API; a second one re-lists the containers every few seconds as a safety
net for events missed while the stream reconnects.

The ``docker`` SDK is imported when a backend first talks to the daemon, never when
the plugin is loaded.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from fiber_core.base.errors import BackendError
from fiber_core.base.options import Option, parse_pairs
from fiber_core.contract.backend import Backend, Job, JobSpec, exitcode_from_status

log = logging.getLogger("fiber")

OPTIONS: tuple[Option, ...] = (
    Option("image", str, None,
           "image of the containers (default: the image of the container this process runs in)"),
    Option("base_url", str, None,
           "Docker daemon, e.g. unix:///var/run/docker.sock (default: DOCKER_HOST, else the local socket)"),
    Option("network_mode", str, None,
           "network of the containers (default: host; container:<own id> when this process runs in a container)"),
    Option("mount_cwd", bool, None,
           "mount the working directory at the same path in every container and start there "
           "(default: on, unless this process runs in a container)"),
    Option("volumes", list, [], "more mounts, comma-separated SOURCE:TARGET[:ro]"),
    Option("extra_env", list, [], "KEY=VALUE pairs set in every container"),
    Option("user", str, None, "user[:group] the containers run as (default: the image's)"),
    Option("check_image", bool, True,
           "check once per image that it runs python and imports fiber_core before the first job"),
    Option("timeout", float, 30.0, "seconds one Docker API call may take before it is an error"),
)

LABEL_RUN = "fiber.run"
LABEL_BACKEND = "fiber.backend"
LABEL_OWNER = "fiber.owner"
"""Which backend instance (one per process) created the container: what cleanup() removes."""

LOG_LIMIT = 1 << 20
"""Bytes of a container's output kept for get_job_logs() (the last ones)."""
RESYNC_SECONDS = 5.0
"""How often the safety re-list runs while jobs are unfinished."""
CHECK_TIMEOUT = 120.0
"""Seconds the image check container may take."""
PARALLEL_STARTS = 8
"""Containers started at once, per backend."""
START_FAILED = 125
"""Exit code of a job whose container the daemon refused to start (``docker run``'s)."""
_LOST = -signal.SIGKILL
"""Exit code of a container that vanished without a ``die`` event we saw (removed by force)."""


class _NotStarted(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code

_NAME_BAD = re.compile(r"[^a-zA-Z0-9_.-]+")
_EXITED = re.compile(r"Exited \((-?\d+)\)")
_CONTAINER_ID = re.compile(r"(?:/containers/|docker[-/]|/docker/)([0-9a-f]{64})")


@dataclass(eq=False)
class _Container:
    """What the backend keeps of one job's container (``Job.handle``)."""

    id: str
    name: str
    exitcode: int | None = None
    done: threading.Event = field(default_factory=threading.Event)
    output: bytearray = field(default_factory=bytearray)
    output_done: threading.Event = field(default_factory=threading.Event)
    missing: int = 0
    """Consecutive re-lists that did not find the container (two make it lost)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    started: bool = False
    signal: str | None = None
    """A signal asked for before the container started: sent once it has."""

    def finish(self, code: int) -> None:
        if self.exitcode is None:
            self.exitcode = code
        self.done.set()


@dataclass
class _ImageCheck:
    ok: bool
    message: str = ""
    transient: bool = False


class DockerBackend(Backend):
    """Every job is a container (``--init --rm``, host networking) on a Docker Engine."""

    name = "docker"
    options = OPTIONS
    package = "fiber-docker"

    # Results of image checks, shared by the backends of this process: (daemon, image id, python).
    _checks: dict[tuple[str, str, str], _ImageCheck] = {}
    _check_locks: dict[tuple[str, str, str], threading.Lock] = {}
    _checks_lock = threading.Lock()

    def __init__(self, settings: Mapping[str, Any] | None = None, run_id: str = "",
                 rundir: str | None = None) -> None:
        super().__init__(settings, run_id, rundir)
        self.owner = secrets.token_hex(4)
        self._lock = threading.RLock()
        self._api: Any = None  # docker.APIClient, with a timeout
        self._stream_api: Any = None  # the same daemon without a read timeout (attach streams)
        self._where = ""
        self._daemon_name: str | None = None
        self._own: dict[str, Any] | None = None
        self._by_id: dict[str, _Container] = {}
        self._count = 0
        self._watcher: _Watcher | None = None
        self._starts = threading.BoundedSemaphore(PARALLEL_STARTS)
        self._started_any = False

    # -- talking to the daemon -------------------------------------------------------

    def _connect(self) -> Any:
        with self._lock:
            if self._api is None:
                api, streams, where = _connect(self.settings)
                try:
                    self._daemon_name = api.info().get("Name")
                except Exception:
                    self._daemon_name = None
                self._own = _own_container(api)
                self._api, self._stream_api, self._where = api, streams, where
            return self._api

    @property
    def in_container(self) -> bool:
        """Whether this process runs in a container of the daemon the jobs go to."""
        self._connect()
        return self._own is not None

    def _network_mode(self) -> str:
        mode = self.settings.get("network_mode")
        if mode:
            return mode
        if self._api is not None and self._own is not None:
            return f"container:{self._own['Id']}"
        return "host"

    def get_listen_addr(self) -> str:
        mode = self.settings.get("network_mode") or "host"
        if mode == "host" or mode.startswith("container:"):
            return "127.0.0.1"
        raise BackendError(
            f"docker network_mode={mode!r}: the containers cannot reach this process on 127.0.0.1. "
            "Set listen_host (FIBER_LISTEN_HOST) to an address of this machine they can reach "
            "(e.g. the network's gateway, 172.17.0.1 for Docker's default bridge), or use "
            "network_mode=host"
        )

    # -- the image -------------------------------------------------------------------

    def _image(self, spec: JobSpec) -> str:
        image = spec.image or self.settings.get("image")
        if image:
            return image
        if self._own is not None:
            return self._own["Image"]
        raise BackendError(
            "no image for docker jobs: set FIBER_DOCKER_IMAGE (or [docker] image in .fiberconfig, "
            "or fiber_core.init(docker_image=...)) to an image that has python3 and fiber-core "
            "installed, e.g. one built FROM python:3.11-slim with `pip install fiber-core`"
        )

    def _check_image(self, image: str, python: str) -> None:
        """Fail at once, with what to do, if the image is missing or cannot run the worker."""
        import docker

        api = self._api
        try:
            image_id = api.inspect_image(image)["Id"]
        except docker.errors.ImageNotFound as e:
            raise BackendError(
                f"image {image!r} is not on the Docker daemon at {self._where}: build it "
                f"(docker build -t {image} .) or pull it (docker pull {image}), or set "
                "FIBER_DOCKER_IMAGE to an image that exists"
            ) from e
        except Exception as e:  # APIError, or the daemon went away (requests' errors)
            raise BackendError(f"cannot inspect image {image!r} on {self._where}: {_explain(e)}") from e
        if not self.settings.get("check_image", True):
            return
        key = (str(api.base_url), image_id, python)
        with self._checks_lock:
            lock = self._check_locks.setdefault(key, threading.Lock())
        with lock:
            with self._checks_lock:
                result = self._checks.get(key)
            if result is None:
                result = self._run_check(image, image_id, python)
                if not result.transient:
                    with self._checks_lock:
                        self._checks[key] = result
        if not result.ok:
            raise BackendError(result.message)

    def _run_check(self, image: str, image_id: str, python: str) -> _ImageCheck:
        code = ("import sys, fiber_core; "
                "print('fiber-check', sys.version_info[0], sys.version_info[1], fiber_core.__version__)")
        spec = JobSpec(command=[python, "-c", code], name="image-check")
        job = self._launch(spec, image, network_mode="none", mounts=False, wait_start=True)
        try:
            status = self.wait_for_job(job, CHECK_TIMEOUT)
            out = self.get_job_logs(job)
        finally:
            if job.handle.exitcode is None:
                self.kill_job(job)
        shown = image if image == image_id else f"{image} ({image_id[7:19]})"
        if status is None:
            return _ImageCheck(False, f"image {shown}: `{python} -c 'import fiber_core'` did not "
                                      f"finish within {CHECK_TIMEOUT:.0f} s; is the daemon overloaded?",
                                transient=True)
        if status == 0:
            found = re.search(r"fiber-check (\d+) (\d+) (\S+)", out)
            if found:
                major, minor, version = found.groups()
                here = f"{sys.version_info[0]}.{sys.version_info[1]}"
                if f"{major}.{minor}" != here:
                    log.warning("fiber: image %s runs Python %s.%s and this process %s: functions and "
                                "lambdas defined in __main__ travel as bytecode and may fail to load",
                                shown, major, minor, here)
                import fiber_core

                if version != fiber_core.__version__:
                    log.warning("fiber: image %s has fiber-core %s and this process %s",
                                shown, version, fiber_core.__version__)
            return _ImageCheck(True)
        tail = "\n".join(out.strip().splitlines()[-5:])
        if status == 127 or "exec" in out and "failed" in out and python in out:
            return _ImageCheck(False, f"image {shown} has no {python!r} (the check exited {status}: "
                                      f"{tail}). Jobs run `{python} -m fiber_core.processes.worker`: use an image "
                                      "with Python and fiber-core, or set the python setting "
                                      "(FIBER_PYTHON) to the interpreter's path in the image")
        if "No module named 'fiber_core'" in out:
            return _ImageCheck(False, f"image {shown} has Python but not fiber-core (`{python} -c "
                                      "'import fiber_core'` failed). Install it in the image: "
                                      "RUN pip install fiber-core (the version this process runs)")
        return _ImageCheck(False, f"image {shown} cannot run the fiber worker: `{python} -c "
                                  f"'import fiber_core'` exited {status}:\n{tail}")

    # -- jobs ------------------------------------------------------------------------

    def create_job(self, spec: JobSpec) -> Job:
        self._connect()
        image = self._image(spec)
        self._check_image(image, spec.command[0])
        # The first container, and GPU ones, start before create_job returns, so that a
        # setting the daemon refuses is an error at once; the others start in the background.
        job = self._launch(spec, image, wait_start=not self._started_any or bool(spec.gpu))
        self._started_any = True
        return job

    def _launch(self, spec: JobSpec, image: str, network_mode: str | None = None,
                mounts: bool = True, wait_start: bool = False) -> Job:
        """Create the container; start it here or in the background (see :meth:`_start`)."""
        import docker

        api = self._api
        self._ensure_watching()
        with self._lock:
            self._count += 1
            n = self._count
        name = _container_name(self.run_id, self.owner, n, spec.name)
        labels = {**{k: str(v) for k, v in spec.labels.items()},
                  LABEL_RUN: self.run_id, LABEL_BACKEND: self.name, LABEL_OWNER: self.owner}
        env = parse_pairs(self.settings.get("extra_env") or (), "docker extra_env")
        env.update(spec.env)
        binds, workdir = self._mounts(spec) if mounts else ([], spec.cwd)
        host_config = api.create_host_config(
            binds=binds or None,
            network_mode=network_mode or self._network_mode(),
            init=True,  # the worker is not PID 1: SIGTERM ends it (-15)
            auto_remove=True,
            nano_cpus=int(spec.cpu * 1e9) if spec.cpu else None,
            mem_limit=int(spec.memory) * 1024 * 1024 if spec.memory else None,
            device_requests=_device_requests(spec.gpu),
        )
        try:
            cid = api.create_container(
                image, command=list(spec.command), name=name, environment=env, labels=labels,
                working_dir=workdir, user=self.settings.get("user") or None, host_config=host_config,
            )["Id"]
        except docker.errors.ImageNotFound as e:
            raise BackendError(f"image {image!r} is not on the Docker daemon at {self._where}: "
                               f"build or pull it, or set FIBER_DOCKER_IMAGE") from e
        except Exception as e:  # APIError, or the daemon went away (requests' errors)
            raise BackendError(f"cannot create a container for {spec.name} from {image!r} on "
                               f"{self._where}: {_explain(e)}") from e
        state = _Container(id=cid, name=name)
        with self._lock:
            self._by_id[cid] = state
        job = Job(id=cid, spec=spec, handle=state, host=self._daemon_name)
        if wait_start:
            stream = self._start(job)
            threading.Thread(target=_read_output, args=(stream, state), daemon=True,
                             name=f"fiber-docker-output-{n}").start()
        else:
            threading.Thread(target=self._start_and_read, args=(job,), daemon=True,
                             name=f"fiber-docker-{n}").start()
        return job

    def _start(self, job: Job) -> Any:
        """Attach to the container's output, then start it; return the output stream.

        Attached before it starts, as `docker run` does: no output is missed however fast
        the job ends (the daemon removes the container as soon as it exits). At most
        :data:`PARALLEL_STARTS` containers start at once.
        """
        state: _Container = job.handle
        stream = None
        try:
            with self._starts:
                with state.lock:
                    if state.signal is not None:  # stopped before it started
                        code = -getattr(signal, state.signal)
                        raise _NotStarted(code)
                stream = self._stream_api.attach(state.id, stdout=True, stderr=True,
                                                 stream=True, logs=True)
                self._api.start(state.id)
        except _NotStarted as e:
            self._forget(state, e.code)
            raise
        except Exception as e:
            if stream is not None:
                _close_stream(stream)
            self._start_failed(job, e)
        with state.lock:
            state.started = True
            pending = state.signal
        if pending is not None:
            self._send(state, pending)
        return stream

    def _start_failed(self, job: Job, e: Exception) -> NoReturn:
        """End a job whose container the daemon would not start, and raise why."""
        import docker

        state: _Container = job.handle
        if isinstance(e, docker.errors.APIError):
            msg = _explain(e)
            if job.spec.gpu and ("device driver" in msg or "gpu" in msg.lower()):
                msg += (". The job asks for GPUs: the Docker daemon needs a GPU and the NVIDIA "
                        "Container Toolkit (nvidia-ctk runtime configure --runtime=docker)")
        else:
            msg = str(e)
        self._forget(state, START_FAILED, f"fiber: docker could not start the container: {msg}")
        raise BackendError(f"cannot start the container of {job.spec.name} ({state.name}): {msg}") from e

    def _start_and_read(self, job: Job) -> None:
        try:
            stream = self._start(job)
        except _NotStarted:
            return
        except BackendError as e:
            log.debug("fiber: %s", e)  # the job ends with START_FAILED and says why in its logs
            return
        _read_output(stream, job.handle)

    def _forget(self, state: _Container, code: int, why: str = "") -> None:
        """End a job whose container never ran: remove it, record ``code`` and ``why``."""
        try:
            self._api.remove_container(state.id, force=True)
        except Exception:
            pass
        if why:
            state.output += why.encode() + b"\n"
        state.output_done.set()
        self._finish(state.id, code)
        state.finish(code)

    def _mounts(self, spec: JobSpec) -> tuple[list[str], str | None]:
        """Bind mounts (``SRC:DST[:MODE]``) and working directory of a job."""
        binds: dict[str, str] = {}
        workdir = spec.cwd
        mount_cwd = self.settings.get("mount_cwd")
        if mount_cwd is None:
            mount_cwd = self._own is None
        if mount_cwd:
            cwd = os.getcwd()
            if cwd != "/":
                binds[cwd] = f"{cwd}:{cwd}"
                workdir = workdir or cwd
        for entry in self.settings.get("volumes") or ():
            parts = entry.split(":")
            if len(parts) not in (2, 3) or not parts[0] or not parts[1]:
                raise BackendError(f"bad docker volumes entry {entry!r}: expected SOURCE:TARGET[:ro|rw]")
            binds[parts[1]] = entry
        for source, target in spec.volumes.items():
            binds[target] = f"{source}:{target}"
        return list(binds.values()), workdir

    def poll_job(self, job: Job) -> int | None:
        return job.handle.exitcode

    def wait_for_job(self, job: Job, timeout: float | None = None) -> int | None:
        job.handle.done.wait(timeout)
        code = job.handle.exitcode
        if code is not None:
            job.state.finish(code)
        return code

    def _signal(self, job: Job, sig: str) -> None:
        state: _Container = job.handle
        with state.lock:
            if state.exitcode is not None:
                return
            if not state.started:  # _start sends it, or does not start the container
                if state.signal != "SIGKILL":
                    state.signal = sig
                return
        self._send(state, sig)

    def _send(self, state: _Container, sig: str) -> None:
        import docker

        try:
            self._api.kill(state.id, signal=sig)
        except docker.errors.NotFound:
            pass  # already exited and removed: its die event gives the code
        except docker.errors.APIError as e:
            if e.status_code == 409:  # not running (exiting, or being removed)
                return
            raise BackendError(f"cannot signal container {state.name}: {_explain(e)}") from e
        except Exception as e:  # the daemon went away (requests' errors)
            raise BackendError(f"cannot signal container {state.name} on {self._where}: {e}") from e

    def terminate_job(self, job: Job) -> None:
        self._signal(job, "SIGTERM")

    def kill_job(self, job: Job) -> None:
        self._signal(job, "SIGKILL")

    def get_job_logs(self, job: Job) -> str:
        state: _Container = job.handle
        if state.exitcode is not None:
            state.output_done.wait(5.0)  # the last bytes may still be on their way
        return bytes(state.output).decode("utf-8", "replace")

    # -- watching exits ----------------------------------------------------------------

    def _ensure_watching(self) -> None:
        with self._lock:
            if self._watcher is None:
                self._watcher = _Watcher(self)

    def _finish(self, cid: str, code: int) -> None:
        with self._lock:
            state = self._by_id.pop(cid, None)
        if state is not None:
            state.finish(code)

    def _resync(self) -> None:
        """One list of this backend's containers: finish the jobs whose exit was missed."""
        with self._lock:
            states = list(self._by_id.values())
        if not states:
            return
        rows = self._api.containers(all=True, filters={"label": [f"{LABEL_OWNER}={self.owner}"]})
        seen = {row["Id"]: row for row in rows}
        for state in states:
            row = seen.get(state.id)
            if row is None:
                # Gone without a die event seen: wait one more round, the event may be in flight.
                state.missing += 1
                if state.missing >= 2:
                    self._finish(state.id, _LOST)
                continue
            state.missing = 0
            found = _EXITED.search(row.get("Status", ""))
            if row.get("State") in ("exited", "dead") and found:
                self._finish(state.id, exitcode_from_status(int(found.group(1))))

    # -- cleanup ---------------------------------------------------------------------

    def cleanup(self) -> None:
        with self._jobs_lock:
            self._jobs = []
        with self._lock:
            api, watcher, self._watcher = self._api, self._watcher, None
            states = list(self._by_id.values())
            self._by_id.clear()
        if api is None:
            return
        try:
            rows = api.containers(all=True, filters={"label": [f"{LABEL_OWNER}={self.owner}"]})
            _remove_all(api, [row["Id"] for row in rows])
        except Exception as e:
            log.warning("fiber: could not remove the containers of this run from %s: %s "
                        "(fiber clean --backend docker --run %s removes them)", self._where, e, self.run_id)
        for state in states:
            state.finish(_LOST)  # killed just now, unless its exit code was already known
        if watcher is not None:
            watcher.stop()

    @classmethod
    def clean(cls, settings: Mapping[str, Any], run_id: str | None = None) -> list[str]:
        api, _, _ = _connect(settings)
        labels = [f"{LABEL_BACKEND}={cls.name}", f"{LABEL_RUN}={run_id}" if run_id else LABEL_RUN]
        rows = api.containers(all=True, filters={"label": labels})
        _remove_all(api, [row["Id"] for row in rows])
        return [f"container {row['Names'][0].lstrip('/')} ({row['Id'][:12]}, run "
                f"{row['Labels'].get(LABEL_RUN)}, {row['State']})" for row in rows]


class _Watcher:
    """Two threads per backend: the daemon's ``die`` events, and a slow safety re-list."""

    def __init__(self, backend: DockerBackend) -> None:
        self.backend = backend
        self.stopped = threading.Event()
        self.events: Any = None
        try:
            self.events = self._open(int(time.time()) - 60)  # before the first container: no exit is missed
        except Exception as e:
            log.debug("fiber: docker event stream failed: %s", e)
        threading.Thread(target=self._follow, daemon=True, name="fiber-docker-events").start()
        threading.Thread(target=self._relist, daemon=True, name="fiber-docker-relist").start()

    def _open(self, since: int | None) -> Any:
        b = self.backend
        filters = {"type": ["container"], "event": ["die"],
                   "label": [f"{LABEL_RUN}={b.run_id}", f"{LABEL_OWNER}={b.owner}"]}
        return b._stream_api.events(since=since, filters=filters, decode=True)

    def _follow(self) -> None:
        # On a reconnect the daemon replays the events since `since` (a minute early, for a
        # daemon whose clock is behind ours: a replayed die event changes nothing).
        since = int(time.time()) - 60
        delay = 0.1
        while not self.stopped.is_set():
            try:
                if self.events is None:
                    self.events = self._open(since)
                    if self.stopped.is_set():  # stop() came before the stream it would close
                        break
                    self.backend._resync()  # what the daemon no longer holds
                for event in self.events:
                    since = max(since, int(event.get("time", since)) - 1)
                    actor = event.get("Actor") or {}
                    code = int((actor.get("Attributes") or {}).get("exitCode", 255))
                    self.backend._finish(event.get("id") or actor.get("ID"), exitcode_from_status(code))
                    delay = 0.1
            except Exception as e:
                if not self.stopped.is_set():
                    log.debug("fiber: docker event stream failed: %s", e)
            if self.events is not None:
                _close_stream(self.events)
            self.events = None
            if self.stopped.wait(delay):
                return
            delay = min(delay * 2, 5.0)

    def _relist(self) -> None:
        while not self.stopped.wait(RESYNC_SECONDS):
            try:
                self.backend._resync()
            except Exception as e:
                log.debug("fiber: docker re-list failed: %s", e)

    def stop(self) -> None:
        self.stopped.set()
        events = self.events
        if events is not None:
            try:
                events.close()  # shuts the socket: _follow's loop ends, and closes the rest
            except Exception:
                pass


# -- helpers -------------------------------------------------------------------------------


def _connect(settings: Mapping[str, Any]) -> tuple[Any, Any, str]:
    """Two clients of the configured daemon, checked to answer, and where it is.

    The first has the ``timeout`` setting; the second none, for the streams that stay
    open as long as a container runs (attach) or the backend lives (events).
    """
    import docker

    base_url = settings.get("base_url")
    timeout = settings.get("timeout") or 30.0
    if base_url:
        where, kwargs = base_url, {"base_url": base_url}
        source = "[docker] base_url (FIBER_DOCKER_BASE_URL)"
    else:
        kwargs = docker.utils.kwargs_from_env()
        where = kwargs.get("base_url") or "unix:///var/run/docker.sock"
        source = "DOCKER_HOST" if os.environ.get("DOCKER_HOST") else "Docker's default"
    try:
        api = docker.APIClient(timeout=timeout, **kwargs)
        api.ping()
        streams = docker.APIClient(version=api.api_version, timeout=None, **kwargs)
    except Exception as e:  # DockerException, requests' ConnectionError, a bad URL
        raise BackendError(
            f"cannot reach the Docker daemon at {where} (from {source}): {e}. Start Docker, or point "
            "DOCKER_HOST or FIBER_DOCKER_BASE_URL at a running daemon; a user other than root needs "
            "access to its socket (the docker group)"
        ) from e
    return api, streams, where


def _own_container(api: Any) -> dict[str, Any] | None:
    """The daemon's view of the container this process runs in, or None."""
    import docker

    candidates: list[str] = []
    for path in ("/proc/self/mountinfo", "/proc/self/cgroup"):
        try:
            with open(path) as f:
                candidates += _CONTAINER_ID.findall(f.read())
        except OSError:
            pass
    host = socket.gethostname()
    if re.fullmatch(r"[0-9a-f]{12}", host):
        candidates.append(host)
    for cid in dict.fromkeys(candidates):
        try:
            attrs = api.inspect_container(cid)
        except docker.errors.APIError:
            continue
        if attrs["Id"].startswith(cid) and (cid != host or attrs["Config"].get("Hostname") == host):
            return attrs
    return None


def _container_name(run_id: str, owner: str, n: int, name: str) -> str:
    safe = _NAME_BAD.sub("-", name).strip("-.") or "job"
    return f"fiber-{run_id}-{owner}-{n}-{safe}"[:120]


def _device_requests(gpu: int | None) -> list[Any] | None:
    """GPUs as Docker device requests: a count, or every GPU for ``-1``."""
    if not gpu:
        return None
    import docker

    return [docker.types.DeviceRequest(count=-1 if gpu < 0 else int(gpu), capabilities=[["gpu"]])]


def _read_output(stream: Any, state: _Container) -> None:
    try:
        for chunk in stream:
            state.output += chunk
            if len(state.output) > 2 * LOG_LIMIT:
                del state.output[:-LOG_LIMIT]
    except Exception:
        pass
    finally:
        state.output_done.set()
        _close_stream(stream)


def _close_stream(stream: Any) -> None:
    """Close a docker SDK stream that no thread reads any more, and its HTTP response.

    Closing the response blocks while another thread reads it: only the reader calls this.

    Left to the garbage collector, the response of an attach stream may be closed after its
    file, which prints "Exception ignored ... I/O operation on closed file" (Python 3.13).
    """
    for close in (getattr(getattr(stream, "_response", None), "close", None), stream.close):
        if close is not None:
            try:
                close()
            except Exception:
                pass


def _remove_all(api: Any, ids: list[str]) -> None:
    """Kill and remove containers, several at a time.

    In threads while they can be started; not at interpreter exit on Python 3.12, where
    cleanup() runs (from atexit) and no thread may start: one after the other there.
    """
    import docker

    left = list(ids)
    lock = threading.Lock()
    errors: list[Exception] = []

    def drain() -> None:
        while True:
            with lock:
                if not left:
                    return
                cid = left.pop()
            try:
                api.remove_container(cid, force=True)
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as e:
                if e.status_code != 409:  # 409: removal already in progress (--rm)
                    errors.append(e)
            except Exception as e:
                errors.append(e)

    threads = []
    for _ in range(min(16, len(ids)) - 1):
        t = threading.Thread(target=drain, daemon=True, name="fiber-docker-remove")
        try:
            t.start()
        except RuntimeError:
            break
        threads.append(t)
    drain()
    for t in threads:
        t.join()
    if errors:
        raise BackendError(f"could not remove {len(errors)} container(s): {_explain(errors[0])}")


def _explain(e: Any) -> str:
    return str(getattr(e, "explanation", None) or e)
