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
SIGKILL is :attr:`~EndReason.OOM`, a SIGKILL with ``OOMKilled`` false and no ``kill`` event
(a ``kill -9`` inside the container) is :attr:`~EndReason.KILLED`; a ``kill`` event this
backend did not cause (``docker stop`` or ``docker kill`` by someone else) is
:attr:`~EndReason.PREEMPTED`; a start the
daemon refuses is :attr:`~EndReason.NEVER_STARTED`; a container gone without a ``die``
event, or a daemon that stopped answering, is :attr:`~EndReason.HOST_LOST`. A job stopped
while its container is paused (``docker pause``) is unpaused after the signal, which would
otherwise wait in the frozen processes (the daemon thaws it only for SIGKILL and the image's
``STOPSIGNAL``); a job stopped as soon as it started is signalled once its init runs the job's
command (:data:`INIT_CHECK_SECONDS`).

The ``docker`` SDK is imported when a backend first talks to the daemon, never when
the plugin is loaded.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from fiber_core.contract import (
    ENV_OPTIONS,
    HOST_LOST_EXITCODE,
    TIMEOUT_ALIAS,
    Backend,
    BackendError,
    EndReason,
    Job,
    JobSpec,
    Option,
    install_elsewhere,
)

from fiber_docker.daemon import (
    close_stream,
    connect,
    core_version,
    explain,
    own_container,
    read_output,
    remove_containers,
    send_and_close,
)
from fiber_docker.spec import (
    LABEL_BACKEND,
    LABEL_OWNER,
    LABEL_RUN,
    command_and_stdin,
    container_labels,
    container_name,
    limits,
    mounts,
)
from fiber_docker.status import (
    START_FAILED,
    ImageCheck,
    check_verdict,
    container_end,
    exitcode,
    thaw_to_signal,
)

log = logging.getLogger("fiber")

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
    *ENV_OPTIONS,
    Option("user", str, None, "user[:group] the containers run as (default: the image's), e.g. your uid, so that files "
           "written in the mounted working directory are yours"),
    Option("check_image", bool, True,
           "check once per image that it runs python and imports fiber_core before the first job"),
    Option("api_timeout", float, 30.0, "seconds one Docker API call may take before it is an error"),
    TIMEOUT_ALIAS,
)

RESYNC_SECONDS = 5.0
"""How often the safety re-list runs while jobs are unfinished."""
CHECK_TIMEOUT = 120.0
"""Seconds the image check container may take."""
PARALLEL_STARTS = 8
"""Containers started at once, per backend."""
INIT_CHECK_SECONDS = 10.0
"""For this long after its start, a container is sent a signal other than SIGKILL only once its
init (docker-init) runs the job's command, waiting at most as long: before that, the init has
not blocked the signals it forwards, and the kernel drops them (the first process of a PID
namespace gets only the signals it handles or blocks): the job would never end."""


@dataclass(eq=False)
class _Container:
    """What the backend keeps of one job's container (``Job.handle``); its end is in ``Job.state``."""

    id: str
    name: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    started: bool = False  # the daemon accepted the start; until then:
    started_at: float = 0.0  # (monotonic) when it did
    signal: str | None = None  # a signal asked for, sent once it has started
    status: int | None = None  # an exit whose die event came before the start call returned
    signalled: bool = False  # this backend sent it a signal: kill events are ours
    outside_signal: str | None = None  # the signal of a kill event we did not cause
    oom: bool = False  # the daemon reported an oom event
    paused: bool = False  # docker pause froze it (pause and unpause events, and the re-list)
    missing: int = 0  # consecutive re-lists that did not find it (two make it lost)
    output_done: threading.Event = field(default_factory=threading.Event)  # the log is whole


class DockerBackend(Backend):
    """Every job is a container (``--init --rm``, host networking) on a Docker Engine."""

    name = "docker"
    options = OPTIONS
    package = "fiber-docker"
    renamed_options = {"timeout": "api_timeout"}
    spare_jobs = 1  # a container takes ~80 ms to start; an idle one costs ~20 MB

    # Results of image checks, shared by the backends of this process: (daemon, image id, python).
    _checks: dict[tuple[str, str, str], ImageCheck] = {}
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
                api, streams, where = connect(self.settings, self.api_timeout)
                try:
                    self._daemon_name = api.info().get("Name")
                except Exception:
                    self._daemon_name = None
                self._own = own_container(api)
                self._api, self._stream_api, self._where = api, streams, where
            return self._api

    def probe(self) -> bool | None:
        """Whether the daemon answers a ping (a restarting one refuses the connection at once);
        ``None`` before this backend ever reached it."""
        api = self._api
        if api is None:
            return None
        try:
            return bool(api.ping())
        except Exception:
            return False

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
        own = self._own["Image"] if self._own is not None else None
        return self.job_image(spec, own, f", e.g. one built FROM python:3.11-slim: {install_elsewhere(image=True)}")

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

    def _run_check(self, image: str, image_id: str, python: str) -> ImageCheck:
        code = ("import sys, fiber_core; "
                "print('fiber-check', sys.version_info[0], sys.version_info[1], fiber_core.__version__)")
        spec = JobSpec(command=[python, "-c", code], name="image-check")
        job = self._launch(spec, image, network_mode="none", mount=False, wait_start=True)
        try:
            status = self.wait_for_job(job, CHECK_TIMEOUT)
            out = self.get_job_logs(job)
        finally:
            if not job.state.done():
                self.stop_job(job, force=True)
        shown = image if image == image_id else f"{image} ({image_id[7:19]})"
        check = check_verdict(status, out, python, shown, CHECK_TIMEOUT, core_version())
        for warning in check.warnings:
            log.warning("fiber: %s", warning)
        return check

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
                mount: bool = True, wait_start: bool = False) -> Job:
        """Create the container; start it here or in the background (see :meth:`_start`)."""
        import docker

        api = self._api
        self._ensure_watching()
        with self._lock:
            self._count += 1
            n = self._count
        name = container_name(self.run_id, self.owner, n, spec.name)
        labels = container_labels(spec, self.run_id, self.name, self.owner)
        command, env, stdin = command_and_stdin(spec.command, self.job_env(spec), spec.secret_env)
        binds, workdir = mounts(spec, self.settings, os.getcwd(), self._own is not None) if mount else ([], spec.cwd)
        host_config = api.create_host_config(
            binds=binds or None,
            network_mode=network_mode or self._network_mode(),
            ipc_mode=self.settings.get("ipc_mode") or None,
            init=True,  # the worker is not PID 1: SIGTERM ends it (-15)
            auto_remove=True,
            **limits(spec),
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
                send_and_close(self._stream_api.attach_socket(cid, params={"stdin": 1, "stream": 1}), stdin)
            except Exception as e:
                try:
                    api.remove_container(cid, force=True)
                except Exception:
                    pass
                raise BackendError(f"cannot send {spec.name} its key on the stdin of its container on "
                                   f"{self._where}", cause=e) from None
        job = self.track_job(Job(id=cid, spec=spec, handle=_Container(id=cid, name=name), host=self._daemon_name))
        if wait_start:
            stream = self._start(job)
            if stream is not None:
                threading.Thread(target=read_output, args=(stream, job), daemon=True,
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
                close_stream(stream)
            self._start_failed(job, e)
        with c.lock:
            c.started, c.started_at = True, time.monotonic()
            pending, status = c.signal, c.status
        if status is not None:  # it ended before we knew it started
            self._finish(job, status)
        elif pending is not None:
            self._send(c, pending)
        return stream

    def _start_failed(self, job: Job, e: Exception) -> NoReturn:
        """End a job whose container the daemon would not start, and raise why."""
        import docker

        hint = ""
        if isinstance(e, docker.errors.APIError):
            msg = explain(e)
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
            read_output(stream, job)

    def _forget(self, job: Job, code: int, reason: EndReason | None = None, detail: str = "") -> None:
        """End a job whose container never ran: remove it, record ``code`` and why."""
        try:
            self._api.remove_container(job.id, force=True)
        except Exception:
            pass
        job.handle.output_done.set()
        job.state.finish(code, reason, detail)

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

        if sig != "SIGKILL" and time.monotonic() - c.started_at < INIT_CHECK_SECONDS:
            self._wait_for_init(c)
        try:
            self._api.kill(c.id, signal=sig)
        except docker.errors.NotFound:
            pass  # already exited and removed: its die event gives the code
        except Exception as e:  # APIError, or the daemon went away (requests' errors)
            if isinstance(e, docker.errors.APIError) and e.status_code == 409:
                return  # not running (exiting, or being removed)
            raise BackendError(f"cannot signal container {c.name} on {self._where}", cause=e) from None
        if thaw_to_signal(sig, c.paused):
            self._thaw(c)

    def _wait_for_init(self, c: _Container) -> None:
        """Wait until the container's init has started the job's command (it has blocked the
        signals it forwards by then), at most until :data:`INIT_CHECK_SECONDS` after the start."""
        deadline = c.started_at + INIT_CHECK_SECONDS
        while time.monotonic() < deadline:
            try:
                if len(self._api.top(c.id)["Processes"]) >= 2:
                    return
            except Exception:  # ended, removed, or the daemon cannot list them: send at once
                return
            time.sleep(0.01)  # the init's start is milliseconds; no event tells it

    def _thaw(self, c: _Container) -> None:
        """Unpause a container that a signal of this backend waits in (a stopped job must end)."""
        try:
            self._api.unpause(c.id)
        except Exception as e:  # 409: thawed already or not running; 404: removed; or the daemon went away
            log.debug("fiber: could not unpause container %s: %s", c.name, explain(e))

    def terminate_job(self, job: Job) -> None:
        self._signal(job, "SIGTERM")

    def kill_job(self, job: Job) -> None:
        self._signal(job, "SIGKILL")

    def get_job_logs(self, job: Job) -> str:
        if job.state.done():  # the exit came by the event stream: the last bytes may be on their way
            job.handle.output_done.wait(5.0)
        return super().get_job_logs(job)

    # -- how jobs end ------------------------------------------------------------------

    def _finish(self, job: Job, code: int, oom_killed: bool | None = None) -> None:
        """Record an exit the daemon reported, and why, from what it said of the container
        (``oom_killed``: its ``State.OOMKilled``, None if not read yet)."""
        c: _Container = job.handle
        oom = c.oom or oom_killed
        if code == -signal.SIGKILL and not (oom or c.signalled or c.outside_signal):
            state = self._state(c)  # the oom event may trail; None: removed already, it cannot say
            oom = None if state is None else bool(state.get("OOMKilled"))
        reason, detail = container_end(code, oom=oom, outside_signal=c.outside_signal,
                                       stop_requested=job.state.stop_requested, memory=job.spec.memory)
        job.state.finish(code, reason, detail)

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
        filters = {"type": ["container"], "event": ["die", "kill", "oom", "pause", "unpause"],
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
            close_stream(stream)

    def _on_event(self, event: dict[str, Any]) -> None:
        actor = event.get("Actor") or {}
        job = self.job_by_id(event.get("id") or actor.get("ID") or "")
        if job is None:
            return
        c: _Container = job.handle
        action, attributes = event.get("Action"), actor.get("Attributes") or {}
        with c.lock:
            if action == "oom":
                c.oom = True
            elif action in ("pause", "unpause"):
                c.paused = action == "pause"
            elif action == "kill" and not c.signalled:
                c.outside_signal = c.outside_signal or str(attributes.get("signal", "?"))
            elif action == "die" and not c.started:  # _start records it once the start call returned
                c.status = exitcode(attributes.get("exitCode", 255))
                return
        if action == "die":
            self._finish(job, exitcode(attributes.get("exitCode", 255)))

    def _resync(self) -> None:
        """One list of this backend's containers: finish the jobs whose exit was missed, and
        every job once the daemon has not answered for ``peer_timeout`` seconds."""
        jobs = [job for job in self.jobs if job.handle.started]
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
                    job.state.finish(HOST_LOST_EXITCODE, EndReason.HOST_LOST, f"the Docker daemon at "
                                     f"{self._where} did not answer for {now - since:.0f} s: {explain(e)}")
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
                    job.state.finish(HOST_LOST_EXITCODE, EndReason.HOST_LOST,
                                     "the container vanished without a die event (removed by force?)")
                continue
            c.missing = 0
            c.paused = row.get("State") == "paused"  # (a pause or unpause event missed)
            if c.paused and c.signalled:  # paused just before our signal, which waits in it
                self._thaw(c)
            state = self._state(c) if row.get("State") in ("exited", "dead") else None
            if state is not None:  # else removed since: its die event, or the next round, tells
                self._finish(job, exitcode(state["ExitCode"]), bool(state.get("OOMKilled")))

    # -- cleanup ---------------------------------------------------------------------

    def cleanup(self) -> None:
        jobs = self.take_jobs()  # all of this backend's containers go at once, below
        with self._lock:
            api, self._watching = self._api, False
            events = self._events
        for job in jobs:
            job.state.stop_requested = True
        if api is not None:
            try:
                rows = api.containers(all=True, filters={"label": [f"{LABEL_OWNER}={self.owner}"]})
                remove_containers(api, [row["Id"] for row in rows])
            except Exception as e:
                log.warning("fiber: could not remove the containers of this run from %s: %s "
                            "(fiber clean --backend docker --run %s removes them)", self._where, e,
                            self.run_id)
        for job in jobs:
            job.state.finish(-signal.SIGKILL)  # killed just now, unless its exit code was already known
        super().cleanup()  # stops the watchers
        if events is not None:
            try:
                events.close()  # shuts the socket: the event watcher's round ends and closes the rest
            except Exception:
                pass

    @classmethod
    def clean(cls, settings: Mapping[str, Any], run_id: str | None = None) -> list[str]:
        settings = cls.complete_settings(settings)
        api, _, _ = connect(settings, float(settings["api_timeout"]))
        labels = [f"{LABEL_BACKEND}={cls.name}", f"{LABEL_RUN}={run_id}" if run_id else LABEL_RUN]
        rows = api.containers(all=True, filters={"label": labels})
        remove_containers(api, [row["Id"] for row in rows])
        return [f"container {row['Names'][0].lstrip('/')} ({row['Id'][:12]}, run "
                f"{row['Labels'].get(LABEL_RUN)}, {row['State']})" for row in rows]
