"""The ``docker`` backend: every Fiber job is a container on a Docker Engine.

How a job starts, whole: :meth:`DockerBackend.create_job` checks the image once (it
must run ``python3 -c "import fiber_core"``), creates a container from it with the
job's command, environment, labels, mounts and limits, and returns; a thread attaches
to the container's output and starts it (several start at once; the first container
of a backend starts before create_job returns). Containers run with host networking,
``--init`` (so the worker is not PID 1 and SIGTERM ends it with -15) and ``--rm``: the
daemon removes a container as soon as it exits, so a run leaves nothing behind even when
its parent is killed (the workers end themselves when their parent's connection drops).

A watcher follows the daemon's event stream for this backend's containers and finishes
each job's state when its ``die`` event comes; a second one re-lists the containers every
few seconds as a safety net for events missed while the stream reconnects. Why a job
ended comes from what the daemon reports: an ``oom`` event (``State.OOMKilled``) before a
SIGKILL is :attr:`~EndReason.OOM`; a ``kill`` event this backend did not cause (``docker
stop`` or ``docker kill`` by someone else) is :attr:`~EndReason.PREEMPTED`; a start the
daemon refuses is :attr:`~EndReason.NEVER_STARTED`; a container gone without a ``die``
event, or a daemon that stopped answering, is :attr:`~EndReason.HOST_LOST`.

The ``docker`` SDK is imported when a backend first talks to the daemon, never when
the plugin is loaded.
"""

from __future__ import annotations

import importlib.metadata
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
from fiber_core.base.log import log
from fiber_core.base.options import Option, parse_pairs
from fiber_core.contract import (
    SECRET_VARIABLES,
    Backend,
    EndReason,
    Job,
    JobSpec,
    exitcode_from_status,
    install_elsewhere,
)

OPTIONS: tuple[Option, ...] = (
    Option("image", str, None,
           "image of the containers (default: the image of the container this process runs in); the "
           "global image setting and Process(image=...), Pool(image=...) take precedence"),
    Option("base_url", str, None,
           "Docker daemon, e.g. unix:///var/run/docker.sock (default: DOCKER_HOST, else the local socket); "
           "DOCKER_TLS_VERIFY and DOCKER_CERT_PATH apply as for the docker CLI"),
    Option("network_mode", str, None,
           "network of the containers (default: host; container:<own id> when this process runs in a container); "
           "any other network needs listen_host"),
    Option("mount_cwd", bool, None,
           "mount the working directory at the same path in every container and start there "
           "(default: on, unless this process runs in a container)"),
    Option("ipc_mode", str, None,
           "IPC namespace of the containers: host shares this machine's /dev/shm and POSIX "
           "semaphores, so Lock, Value, Array and SharedMemory are attached, not served: the stdlib's "
           "speed, np.frombuffer(arr.get_obj()) and gymnasium's shared_memory=True work "
           "(default: the daemon's, private)"),
    Option("volumes", list, [], "more mounts, comma-separated SOURCE:TARGET[:ro]"),
    Option("extra_env", list, [], "KEY=VALUE pairs set in every container"),
    Option("user", str, None, "user[:group] the containers run as (default: the image's), e.g. your uid, so that files "
           "written in the mounted working directory are yours"),
    Option("check_image", bool, True,
           "check once per image that it runs python and imports fiber_core before the first job"),
    Option("timeout", float, 30.0, "seconds one Docker API call may take before it is an error"),
)

LABEL_RUN = "fiber.run"
LABEL_BACKEND = "fiber.backend"
LABEL_OWNER = "fiber.owner"
"""Which backend instance (one per process) created the container: what cleanup() removes."""

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
_UNREACHABLE = 255
"""Exit code of a job on a daemon that stopped answering (its fate is unknown; ssh's code)."""

_NAME_BAD = re.compile(r"[^a-zA-Z0-9_.-]+")
_CONTAINER_ID = re.compile(r"(?:/containers/|docker[-/]|/docker/)([0-9a-f]{64})")


@dataclass(eq=False)
class _Container:
    """What the backend keeps of one job's container (``Job.handle``); its end is in ``Job.state``."""

    id: str
    name: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    started: bool = False  # the daemon accepted the start; until then:
    signal: str | None = None  # a signal asked for, sent once it has started
    status: int | None = None  # an exit whose die event came before the start call returned
    signalled: bool = False  # this backend sent it a signal: kill events are ours
    outside_signal: str | None = None  # the signal of a kill event we did not cause
    oom: bool = False  # the daemon reported an oom event
    missing: int = 0  # consecutive re-lists that did not find it (two make it lost)
    output_done: threading.Event = field(default_factory=threading.Event)  # the log is whole


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
    spare_jobs = 1  # a container takes ~80 ms to start; an idle one costs ~20 MB

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
        self._by_id: dict[str, Job] = {}  # the unfinished jobs, by container id
        self._count = 0
        self._watching = False
        self._relist: Any = None  # the re-list Watcher, woken when the event stream reconnects
        self._events: Any = None  # the event stream being read
        self._since = 0  # where a reconnected event stream resumes (daemon time, seconds)
        self._unreachable_since: float | None = None
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
            f"installed, e.g. one built FROM python:3.11-slim: {install_elsewhere(image=True)}"
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
                "FIBER_DOCKER_IMAGE to an image that exists", cause=e) from None
        except Exception as e:  # APIError, or the daemon went away (requests' errors)
            raise BackendError(f"cannot inspect image {image!r} on {self._where}", cause=e) from None
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
            if not job.state.done():
                self.stop_job(job, force=True)
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
                mine = _core_version()
                if mine and version != mine:
                    log.warning("fiber: image %s has fiber-core %s and this process %s", shown, version, mine)
            return _ImageCheck(True)
        tail = "\n".join(out.strip().splitlines()[-5:])
        if status == 127 or "exec" in out and "failed" in out and python in out:
            return _ImageCheck(False, f"image {shown} has no {python!r} (the check exited {status}: "
                                      f"{tail}). Jobs run `{python} -m fiber_core.processes.worker`: use an image "
                                      "with Python and fiber-core, or set the python setting "
                                      "(FIBER_PYTHON) to the interpreter's path in the image")
        if "No module named 'fiber_core'" in out:
            return _ImageCheck(False, f"image {shown} has Python but not fiber-core (`{python} -c "
                                      "'import fiber_core'` failed). Install it in the image, the "
                                      f"version this process runs: {install_elsewhere(image=True)}")
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
        command, stdin = list(spec.command), b""
        if SECRET_VARIABLES & set(env):  # not in the container's config, which `docker inspect` shows
            command = ["/bin/sh", "-c", SECRETS_SHELL, "fiber-job", *command]
            stdin = "".join(f"{k}={env.pop(k)}\n" for k in sorted(SECRET_VARIABLES & set(env))).encode() + b"\n"
        binds, workdir = self._mounts(spec) if mounts else ([], spec.cwd)
        host_config = api.create_host_config(
            binds=binds or None,
            network_mode=network_mode or self._network_mode(),
            ipc_mode=self.settings.get("ipc_mode") or None,
            init=True,  # the worker is not PID 1: SIGTERM ends it (-15)
            auto_remove=True,
            nano_cpus=int(spec.cpu * 1e9) if spec.cpu else None,
            mem_limit=int(spec.memory) * 1024 * 1024 if spec.memory else None,
            device_requests=_device_requests(spec.gpu),
        )
        try:
            cid = api.create_container(
                image, command=command, name=name, environment=env, labels=labels,
                working_dir=workdir, user=self.settings.get("user") or None, host_config=host_config,
                stdin_open=bool(stdin),  # and StdinOnce: its stdin ends when we detach
            )["Id"]
        except docker.errors.ImageNotFound as e:
            raise BackendError(f"image {image!r} is not on the Docker daemon at {self._where}: "
                               f"build or pull it, or set FIBER_DOCKER_IMAGE", cause=e) from None
        except Exception as e:  # APIError, or the daemon went away (requests' errors)
            raise BackendError(f"cannot create a container for {spec.name} from {image!r} on "
                               f"{self._where}", cause=e) from None
        if stdin:
            try:  # the daemon keeps it for the container's start; detaching then ends its stdin
                _send_and_close(self._stream_api.attach_socket(cid, params={"stdin": 1, "stream": 1}), stdin)
            except Exception as e:
                try:
                    api.remove_container(cid, force=True)
                except Exception:
                    pass
                raise BackendError(f"cannot send {spec.name} its key on the stdin of its container on "
                                   f"{self._where}", cause=e) from None
        job = Job(id=cid, spec=spec, handle=_Container(id=cid, name=name), host=self._daemon_name)
        with self._lock:
            self._by_id[cid] = job
        if wait_start:
            stream = self._start(job)
            if stream is not None:
                threading.Thread(target=_read_output, args=(stream, job), daemon=True,
                                 name=f"fiber-docker-output-{n}").start()
        else:
            threading.Thread(target=self._start_and_read, args=(job,), daemon=True,
                             name=f"fiber-docker-{n}").start()
        return job

    def _start(self, job: Job) -> Any:
        """Attach to the container's output, then start it; return the output stream.

        Attached before it starts, as `docker run` does: no output is missed however fast
        the job ends (the daemon removes the container as soon as it exits). At most
        :data:`PARALLEL_STARTS` containers start at once. Returns ``None`` when the job was
        stopped before it started: its container is removed unstarted.
        """
        c: _Container = job.handle
        stream = None
        try:
            with self._starts:
                with c.lock:
                    pending = c.signal
                if pending is not None:
                    self._forget(job, -getattr(signal, pending))
                    return None
                stream = self._stream_api.attach(c.id, stdout=True, stderr=True, stream=True, logs=True)
                self._api.start(c.id)
        except Exception as e:
            if stream is not None:
                _close_stream(stream)
            self._start_failed(job, e)
        with c.lock:
            c.started = True
            pending, status = c.signal, c.status
        if status is not None:  # it ended before we knew it started
            self._died(job, status)
        elif pending is not None:
            self._send(c, pending)
        return stream

    def _start_failed(self, job: Job, e: Exception) -> NoReturn:
        """End a job whose container the daemon would not start, and raise why."""
        import docker

        hint = ""
        if isinstance(e, docker.errors.APIError):
            msg = _explain(e)
            if job.spec.gpu and ("device driver" in msg or "gpu" in msg.lower()):
                hint = (": the job asks for GPUs, so the Docker daemon needs a GPU and the NVIDIA "
                        "Container Toolkit (nvidia-ctk runtime configure --runtime=docker)")
        else:
            msg = str(e)
        job.state.log.append(f"fiber: docker could not start the container: {msg}{hint}\n")
        self._forget(job, START_FAILED, EndReason.NEVER_STARTED, f"the daemon would not start it: {msg}{hint}")
        raise BackendError(f"cannot start the container of {job.spec.name} ({job.handle.name}){hint}",
                           cause=e) from None

    def _start_and_read(self, job: Job) -> None:
        try:
            stream = self._start(job)
        except BackendError as e:
            log.debug("fiber: %s", e)  # the job ends with START_FAILED and says why in its logs
            return
        if stream is not None:
            _read_output(stream, job)

    def _forget(self, job: Job, code: int, reason: EndReason | None = None, detail: str = "") -> None:
        """End a job whose container never ran: remove it, record ``code`` and why."""
        try:
            self._api.remove_container(job.id, force=True)
        except Exception:
            pass
        job.handle.output_done.set()
        self._end(job, code, reason, detail)

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

    def _signal(self, job: Job, sig: str) -> None:
        c: _Container = job.handle
        with c.lock:
            if job.state.done():
                return
            c.signalled = True
            if not c.started:  # _start sends it, or does not start the container
                if c.signal != "SIGKILL":
                    c.signal = sig
                return
        self._send(c, sig)

    def _send(self, c: _Container, sig: str) -> None:
        import docker

        try:
            self._api.kill(c.id, signal=sig)
        except docker.errors.NotFound:
            pass  # already exited and removed: its die event gives the code
        except Exception as e:  # APIError, or the daemon went away (requests' errors)
            if isinstance(e, docker.errors.APIError) and e.status_code == 409:
                return  # not running (exiting, or being removed)
            raise BackendError(f"cannot signal container {c.name} on {self._where}", cause=e) from None

    def terminate_job(self, job: Job) -> None:
        self._signal(job, "SIGTERM")

    def kill_job(self, job: Job) -> None:
        self._signal(job, "SIGKILL")

    def get_job_logs(self, job: Job) -> str:
        if job.state.done():  # the exit came by the event stream: the last bytes may be on their way
            job.handle.output_done.wait(5.0)
        return super().get_job_logs(job)

    # -- how jobs end ------------------------------------------------------------------

    def _end(self, job: Job, code: int, reason: EndReason | None = None, detail: str = "") -> None:
        with self._lock:
            self._by_id.pop(job.id, None)
        job.state.finish(code, reason, detail)

    def _died(self, job: Job, code: int, oom_killed: bool = False) -> None:
        """Record an exit the daemon reported, and why, from what it said of the container."""
        c: _Container = job.handle
        if code == -signal.SIGKILL and not (c.oom or oom_killed or c.signalled or c.outside_signal):
            oom_killed = bool((self._state(c) or {}).get("OOMKilled"))  # the oom event may trail
        if code == -signal.SIGKILL and (c.oom or oom_killed):
            # The flag is the container's: it says the exit was the OOM kill only with SIGKILL's code.
            limit = job.spec.memory
            self._end(job, code, EndReason.OOM, f"OOMKilled: out of memory, over the container's limit "
                      f"of {limit} MiB" if limit else "OOMKilled: out of memory (no memory limit was set)")
        elif c.outside_signal is not None and code < 0 and not job.state.stop_requested:
            self._end(job, code, EndReason.PREEMPTED, f"stopped from outside Fiber: the daemon sent "
                      f"signal {c.outside_signal} (docker stop or docker kill)")
        else:
            self._end(job, code)  # its own exit, or STOPPED when Fiber asked for it

    def _state(self, c: _Container) -> dict[str, Any] | None:
        """The daemon's ``State`` of a container, ``None`` once it is removed."""
        try:
            return self._api.inspect_container(c.id)["State"]
        except Exception:
            return None

    # -- watching ----------------------------------------------------------------------

    def _ensure_watching(self) -> None:
        with self._lock:
            if self._watching:
                return
            self._watching = True
            self._since = int(time.time()) - 60  # before the first container: no exit is missed
            self._relist = self.watch(self._resync, "relist", interval=RESYNC_SECONDS)
            self.watch(self._follow_events, "events", interval=0.1, max_backoff=5.0)

    def _follow_events(self) -> None:
        """Read the daemon's events for this backend's containers until the stream breaks.

        On a reconnect the daemon replays the events since ``_since`` (a minute early, for a
        daemon whose clock is behind ours: a replayed event changes nothing), and the re-list
        runs at once for what the daemon no longer holds.
        """
        filters = {"type": ["container"], "event": ["die", "kill", "oom"],
                   "label": [f"{LABEL_RUN}={self.run_id}", f"{LABEL_OWNER}={self.owner}"]}
        stream = self._stream_api.events(since=self._since, filters=filters, decode=True)
        with self._lock:
            closing = not self._watching  # cleanup came before the stream it would close
            if not closing:
                self._events = stream
                self._relist.wake()
        try:
            if not closing:
                for event in stream:
                    self._since = max(self._since, int(event.get("time", self._since)) - 1)
                    self._on_event(event)
        finally:
            with self._lock:
                if self._events is stream:
                    self._events = None
            _close_stream(stream)

    def _on_event(self, event: dict[str, Any]) -> None:
        actor = event.get("Actor") or {}
        with self._lock:
            job = self._by_id.get(event.get("id") or actor.get("ID") or "")
        if job is None:
            return
        c: _Container = job.handle
        action, attributes = event.get("Action"), actor.get("Attributes") or {}
        with c.lock:
            if action == "oom":
                c.oom = True
            elif action == "kill" and not c.signalled:
                c.outside_signal = c.outside_signal or str(attributes.get("signal", "?"))
            elif action == "die" and not c.started:  # _start records it once the start call returned
                c.status = _exitcode(attributes.get("exitCode", 255))
                return
        if action == "die":
            self._died(job, _exitcode(attributes.get("exitCode", 255)))

    def _resync(self) -> None:
        """One list of this backend's containers: finish the jobs whose exit was missed, and
        every job once the daemon has not answered for ``peer_timeout`` seconds."""
        with self._lock:
            jobs = [job for job in self._by_id.values() if job.handle.started]
        if not jobs:
            self._unreachable_since = None
            return
        try:
            rows = self._api.containers(all=True, filters={"label": [f"{LABEL_OWNER}={self.owner}"]})
        except Exception as e:
            now = time.monotonic()
            since = self._unreachable_since = self._unreachable_since or now
            if now - since >= self.peer_timeout:
                for job in jobs:
                    self._end(job, _UNREACHABLE, EndReason.HOST_LOST, f"the Docker daemon at "
                              f"{self._where} did not answer for {now - since:.0f} s: {_explain(e)}")
            raise
        self._unreachable_since = None
        seen = {row["Id"]: row for row in rows}
        for job in jobs:
            c: _Container = job.handle
            row = seen.get(c.id)
            if row is None:
                # Gone without a die event seen: wait one more round, the event may be in flight.
                c.missing += 1
                if c.missing >= 2:
                    self._end(job, _LOST, EndReason.HOST_LOST,
                              "the container vanished without a die event (removed by force?)")
                continue
            c.missing = 0
            state = self._state(c) if row.get("State") in ("exited", "dead") else None
            if state is not None:  # else removed since: its die event, or the next round, tells
                self._died(job, _exitcode(state["ExitCode"]), bool(state.get("OOMKilled")))

    # -- cleanup ---------------------------------------------------------------------

    def cleanup(self) -> None:
        self.take_jobs()  # all of this backend's containers go at once, below
        with self._lock:
            api, self._watching = self._api, False
            events, jobs = self._events, list(self._by_id.values())
            self._by_id.clear()
        for job in jobs:
            job.state.stop_requested = True
        if api is not None:
            try:
                rows = api.containers(all=True, filters={"label": [f"{LABEL_OWNER}={self.owner}"]})
                _remove_all(api, [row["Id"] for row in rows])
            except Exception as e:
                log.warning("fiber: could not remove the containers of this run from %s: %s "
                            "(fiber clean --backend docker --run %s removes them)", self._where, e,
                            self.run_id)
        for job in jobs:
            job.state.finish(_LOST)  # killed just now, unless its exit code was already known
        super().cleanup()  # stops the watchers
        if events is not None:
            try:
                events.close()  # shuts the socket: the event watcher's round ends and closes the rest
            except Exception:
                pass

    @classmethod
    def clean(cls, settings: Mapping[str, Any], run_id: str | None = None) -> list[str]:
        api, _, _ = _connect(settings)
        labels = [f"{LABEL_BACKEND}={cls.name}", f"{LABEL_RUN}={run_id}" if run_id else LABEL_RUN]
        rows = api.containers(all=True, filters={"label": labels})
        _remove_all(api, [row["Id"] for row in rows])
        return [f"container {row['Names'][0].lstrip('/')} ({row['Id'][:12]}, run "
                f"{row['Labels'].get(LABEL_RUN)}, {row['State']})" for row in rows]


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
            f"cannot reach the Docker daemon at {where} (from {source}). Start Docker, or point "
            "DOCKER_HOST or FIBER_DOCKER_BASE_URL at a running daemon; a user other than root must be "
            "in the docker group to use its socket", cause=e) from None
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


def _read_output(stream: Any, job: Job) -> None:
    try:
        for chunk in stream:
            job.state.log.append(chunk)
    except Exception:
        pass
    finally:
        job.handle.output_done.set()
        _close_stream(stream)


SECRETS_SHELL = 'while IFS= read -r v && [ -n "$v" ]; do export "$v"; done; exec "$@"'
"""Runs a job's command with the variables written on its stdin (``NAME=VALUE`` lines, then an
empty one) in its environment: the run's key and the job's token, which would otherwise be in
the container's config for anyone allowed ``docker inspect`` to read."""


def _send_and_close(sock: Any, data: bytes) -> None:
    """Write ``data`` on a container's attached stdin and detach (its stdin then ends)."""
    raw = getattr(sock, "_sock", sock)  # docker's SocketIO wraps the socket
    try:
        raw.sendall(data)
    finally:
        raw.close()
        if raw is not sock:
            sock.close()


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


def _core_version() -> str | None:
    """The version of the fiber-core this process runs, if it is installed."""
    try:
        return importlib.metadata.version("fiber-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def _exitcode(status: Any) -> int:
    """``multiprocessing``'s exit code of the daemon's ``128 + N`` status."""
    return exitcode_from_status(int(status)) or 0


def _explain(e: Any) -> str:
    return str(getattr(e, "explanation", None) or e)
