"""fiber-docker against a real Docker Engine: the conformance suite, then what only Docker has.

Nothing is mocked: every job is a container on the private dockerd that
``scripts/services/docker.sh`` starts (host networking only, no registry), from the
images it builds. Functions that Pool workers run live in ``docker_tasks.py``: the
containers import it through the mounted working directory.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import secrets
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import docker_tasks
import fiber_core
import pytest
from docker_service import IMAGE, NOFIBER_IMAGE, NOPYTHON_IMAGE
from fiber_core.base.errors import BackendError, TaskLostError
from fiber_core.contract import HOST_LOST_EXITCODE, Backend, EndReason, Job, JobSpec
from fiber_core.parallel.pool.ledger import MAX_TASK_KILLS
from fiber_core.runtime.config import create_backend, plugins
from fiber_core.testing import BackendConformance, failing_program
from fiber_core.testing.outage import Outage

import fiber_docker.backend
from fiber_docker.backend import (
    LABEL_OWNER,
    LABEL_RUN,
    START_FAILED,
    DockerBackend,
)

pytestmark = pytest.mark.usefixtures("docker_env")

WAIT = 120.0  # bound of every wait on a container


class TestDocker(BackendConformance):
    backend_name = "docker"
    python = "python3"
    start_timeout = WAIT

# -- helpers ----------------------------------------------------------------------------------


@pytest.fixture
def backend() -> Iterator[DockerBackend]:
    b = create_backend("docker", "t" + secrets.token_hex(4))
    try:
        yield b
    finally:
        b.cleanup()


def make_backend(**settings: object) -> DockerBackend:
    """A backend with the configured settings (FIBER_DOCKER_*), and ``settings`` on top."""
    from fiber_core.runtime.config import config

    plugins().get_class("docker")  # loads the plugins: their options become known
    return DockerBackend({**config.backend_settings("docker"), **settings}, "t" + secrets.token_hex(4))


def sleeper(name: str = "sleeper", **kw: object) -> JobSpec:
    return JobSpec(command=["python3", "-c", "import time; print('up', flush=True); time.sleep(600)"],
                   name=name, **kw)  # type: ignore[arg-type]


def wait_output(backend: Backend, job: Job, marker: str) -> str:
    deadline = time.monotonic() + WAIT
    while marker not in (logs := backend.get_job_logs(job)):
        assert backend.poll_job(job) is None, logs
        assert time.monotonic() < deadline, f"no {marker!r} from the job in time: {logs!r}"
        time.sleep(0.05)
    return logs


def run_job(backend: Backend, code: str, **kw: object) -> tuple[int | None, str]:
    job = backend.start_job(JobSpec(command=["python3", "-c", code], name="probe", **kw))  # type: ignore[arg-type]
    status = backend.wait_for_job(job, WAIT)
    return status, backend.get_job_logs(job)


def containers(api: docker.APIClient, *labels: str) -> list[dict]:
    return api.containers(all=True, filters={"label": list(labels)})


def wait_gone(api: docker.APIClient, ids: set[str], since: int) -> None:
    """Wait (bounded) for the daemon's destroy events of ``ids``; they must all come."""
    if not {c["Id"] for c in api.containers(all=True)} & ids:
        return
    events = api.events(since=since, until=since + int(WAIT), decode=True,
                        filters={"type": ["container"], "event": ["destroy"]})
    left = set(ids)
    for event in events:
        left.discard(event.get("id"))
        if not left:
            events.close()
            break
    assert not left, f"containers not removed within {WAIT:.0f} s: {sorted(left)}"


# -- the container a job gets -------------------------------------------------------------------


def test_container_settings(backend: DockerBackend, docker_api: docker.APIClient) -> None:
    spec = sleeper("Process-1:2 weird/name", cpu=0.5, memory=256,
                   labels={"fiber.run": backend.run_id, "fiber.parent": "4242", "fiber.name": "Process-1:2"})
    job = backend.start_job(spec)
    wait_output(backend, job, "up")
    info = docker_api.inspect_container(job.id)
    assert info["Name"].lstrip("/").endswith("-Process-1-2-weird-name")
    labels = info["Config"]["Labels"]
    assert labels[LABEL_RUN] == backend.run_id
    assert labels["fiber.parent"] == "4242"
    assert labels["fiber.name"] == "Process-1:2"
    assert labels["fiber.backend"] == "docker"
    assert labels[LABEL_OWNER] == backend.owner
    host = info["HostConfig"]
    assert host["NanoCpus"] == 500_000_000
    assert host["Memory"] == 256 * 1024 * 1024
    assert host["Init"] is True
    assert host["AutoRemove"] is True
    assert host["NetworkMode"] == "host"
    assert f"{os.getcwd()}:{os.getcwd()}" in host["Binds"]
    assert info["Config"]["WorkingDir"] == os.getcwd()
    assert info["Config"]["Image"] == IMAGE
    backend.kill_job(job)
    assert backend.wait_for_job(job, WAIT) == -signal.SIGKILL


def test_working_directory_and_volumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work, data = tmp_path / "work", tmp_path / "data"
    work.mkdir()
    data.mkdir()
    (work / "here.txt").write_text("from the working directory")
    (data / "there.txt").write_text("from a volume")
    monkeypatch.chdir(work)
    b = make_backend(volumes=[f"{data}:/data:ro"])
    try:
        status, logs = run_job(b, "import os; print(os.getcwd()); print(open('here.txt').read()); "
                                  "print(open('/data/there.txt').read()); open('out.txt', 'w').write('x'); "
                                  "open('/data/no', 'w')")
        assert status == 1  # the volume is read-only
        assert str(work) in logs
        assert "from the working directory" in logs and "from a volume" in logs
        assert "Read-only file system" in logs
        assert (work / "out.txt").read_text() == "x"  # the working directory is shared
    finally:
        b.cleanup()
    b = make_backend(mount_cwd=False)
    try:
        status, logs = run_job(b, "import os; print('cwd', os.getcwd(), os.path.exists('here.txt'))")
        assert status == 0, logs
        assert f"cwd {work}" not in logs and "False" in logs
    finally:
        b.cleanup()


def test_user_and_extra_env() -> None:
    b = make_backend(user="1234:1234", extra_env=["FIBER_TEST_A=1", "FIBER_TEST_B=x=y"])
    try:
        status, logs = run_job(b, "import os; print(os.getuid(), os.getgid(), os.environ['FIBER_TEST_A'], "
                                  "os.environ['FIBER_TEST_B'], os.environ['FROM_SPEC'])",
                               env={"FROM_SPEC": "s", "FIBER_TEST_A": "spec wins"})
        assert status == 0, logs
        assert "1234 1234 spec wins x=y s" in logs
    finally:
        b.cleanup()


def test_gpu_requests(backend: DockerBackend, docker_api: docker.APIClient) -> None:
    # This daemon has no GPU: the request reaches it, and the refusal is immediate and explained.
    for gpu in (1, -1):
        with pytest.raises(BackendError, match="GPU") as e:
            backend.start_job(sleeper(gpu=gpu))
        assert "NVIDIA Container Toolkit" in str(e.value)
    assert containers(docker_api, f"{LABEL_OWNER}={backend.owner}") == []


def test_many_jobs_exit_codes(backend: DockerBackend) -> None:
    jobs = [backend.start_job(JobSpec(command=["python3", "-c", f"import sys; sys.exit({i})"],
                                      name=f"j{i}")) for i in range(12)]
    assert [backend.wait_for_job(job, WAIT) for job in jobs] == list(range(12))
    assert [backend.poll_job(job) for job in jobs] == list(range(12))


def test_stop_before_or_while_starting(backend: DockerBackend, docker_api: docker.APIClient) -> None:
    first = backend.start_job(sleeper())  # the first starts in create_job; the others later
    jobs = [backend.start_job(sleeper(f"s{i}")) for i in range(4)]
    backend.terminate_job(jobs[0])
    backend.kill_job(jobs[1])
    backend.terminate_job(jobs[2])
    backend.kill_job(jobs[2])
    assert backend.wait_for_job(jobs[0], WAIT) == -signal.SIGTERM
    assert backend.wait_for_job(jobs[1], WAIT) == -signal.SIGKILL
    assert backend.wait_for_job(jobs[2], WAIT) in (-signal.SIGTERM, -signal.SIGKILL)
    wait_output(backend, jobs[3], "up")
    backend.cleanup()
    assert backend.wait_for_job(first, WAIT) == -signal.SIGKILL
    assert containers(docker_api, f"{LABEL_OWNER}={backend.owner}") == []


def test_network_mode_needs_a_listen_host() -> None:
    assert make_backend().get_listen_addr() == "127.0.0.1"
    assert make_backend(network_mode="container:abc").get_listen_addr() == "127.0.0.1"
    with pytest.raises(BackendError, match="listen_host"):
        make_backend(network_mode="bridge").get_listen_addr()


# -- why a job ended -----------------------------------------------------------------------------


def test_end_exited(backend: DockerBackend) -> None:
    jobs = [backend.start_job(JobSpec(command=["python3", "-c", code], name="exits")) for code in (
        "import sys; sys.exit(3)",
        "import os, signal; os.kill(os.getpid(), signal.SIGTERM)",  # a signal nobody else sent
    )]
    assert [backend.wait_for_job(job, WAIT) for job in jobs] == [3, -signal.SIGTERM]
    assert [job.state.reason for job in jobs] == [EndReason.EXITED, EndReason.EXITED]


def test_a_job_sigkilled_inside_its_container_ends_killed_not_oom(backend: DockerBackend) -> None:
    # No kill event (the daemon sent nothing) and State.OOMKilled false: not the OOM killer.
    job = backend.start_job(JobSpec(command=["python3", "-c", "import os; os.kill(os.getpid(), 9)"],
                                    name="self-kill"))
    assert backend.wait_for_job(job, WAIT) == -signal.SIGKILL
    assert job.state.reason is EndReason.KILLED, job.state.detail
    assert "OOMKilled: false" in job.state.detail


def test_end_oom(backend: DockerBackend) -> None:
    hog = JobSpec(command=["python3", "-c", "b = b'x' * (256 << 20); print('survived', len(b))"],
                  name="hog", memory=64)
    job = backend.start_job(hog)
    assert backend.wait_for_job(job, WAIT) == -signal.SIGKILL, backend.get_job_logs(job)
    assert job.state.reason is EndReason.OOM
    assert "64 MiB" in job.state.detail
    assert "survived" not in backend.get_job_logs(job)


@pytest.mark.parametrize(("how", "code"), [("stop", -signal.SIGTERM), ("kill", -signal.SIGKILL)])
def test_end_preempted(how: str, code: int, backend: DockerBackend, docker_api: docker.APIClient) -> None:
    job = backend.start_job(sleeper())
    wait_output(backend, job, "up")
    if how == "stop":
        docker_api.stop(job.id, timeout=30)  # someone else's docker stop
    else:
        docker_api.kill(job.id)
    assert backend.wait_for_job(job, WAIT) == code
    assert job.state.reason is EndReason.PREEMPTED
    assert "outside Fiber" in job.state.detail


def test_end_stopped(backend: DockerBackend) -> None:
    running = [backend.start_job(sleeper(f"run{i}")) for i in range(2)]
    for job in running:
        wait_output(backend, job, "up")
    unstarted = backend.start_job(sleeper("unstarted"))  # stopped before or while it starts
    backend.stop_job(running[0])
    backend.stop_job(running[1], force=True)
    backend.stop_job(unstarted)
    assert [backend.wait_for_job(job, WAIT) for job in running] == [-signal.SIGTERM, -signal.SIGKILL]
    assert backend.wait_for_job(unstarted, WAIT) == -signal.SIGTERM
    assert {job.state.reason for job in [*running, unstarted]} == {EndReason.STOPPED}


def test_end_never_started(backend: DockerBackend, tmp_path: Path) -> None:
    backend.start_job(sleeper())  # the first job starts in create_job: a refusal would raise there
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    # The daemon creates the container, then refuses to start it: a file mounted over a directory.
    job = backend.start_job(sleeper("refused", volumes={str(a_file): "/usr"}))
    assert backend.wait_for_job(job, WAIT) == START_FAILED
    assert job.state.reason is EndReason.NEVER_STARTED
    assert "not a directory" in job.state.detail
    assert "docker could not start the container" in backend.get_job_logs(job)


def test_end_host_lost(tmp_path: Path, docker_host: str, docker_api: docker.APIClient,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    relay = Outage.unix(str(tmp_path / "docker.sock"), docker_host.removeprefix("unix://"))
    monkeypatch.setattr(fiber_docker.backend, "RESYNC_SECONDS", 0.2)  # the re-list notices at once
    b = make_backend(base_url=f"unix://{tmp_path / 'docker.sock'}")
    b.peer_timeout = 1.0
    try:
        job = b.start_job(sleeper())
        wait_output(b, job, "up")
        relay.cut()
        assert b.wait_for_job(job, WAIT) == HOST_LOST_EXITCODE
        assert job.state.reason is EndReason.HOST_LOST
        assert "did not answer" in job.state.detail
    finally:
        relay.cut()
        b.cleanup()  # cannot reach the daemon any more: the container is removed here
        for c in containers(docker_api, f"{LABEL_OWNER}={b.owner}"):
            docker_api.remove_container(c["Id"], force=True)


def test_a_pool_starts_workers_as_soon_as_the_daemon_answers_again_and_says_so(
        tmp_path: Path, docker_host: str, caplog: pytest.LogCaptureFixture) -> None:
    # The daemon goes away (a Unix socket in front of it refuses connections, as a restarting
    # dockerd's does) while a pool needs new workers: each worker takes one task.
    from fiber_core.runtime.config import config

    path = tmp_path / "docker.sock"
    relay = Outage.unix(str(path), docker_host.removeprefix("unix://"))
    fiber_core.init(docker_base_url=f"unix://{path}")
    try:
        with caplog.at_level(logging.INFO, logger="fiber"), \
                fiber_core.Pool(2, backend="docker", maxtasksperchild=1) as pool:
            assert pool.map(docker_tasks.square, range(2), chunksize=1) == [0, 1]
            relay.cut()
            results = pool.imap(docker_tasks.square, range(6), chunksize=1)
            refusals = "cannot start a pool worker, waiting for the backend"
            deadline = time.monotonic() + WAIT
            while caplog.text.count(refusals) < 4:  # the backoff has grown to seconds
                assert time.monotonic() < deadline, caplog.text
                time.sleep(0.05)
            with pool._lock:
                slot = pool._start_retry_at  # the next try, as the backoff would have it
                assert slot is not None
            slot_wall = time.time() + (slot - time.monotonic())
            relay.restore()  # the daemon answers again
            assert [results.next(WAIT) for _ in range(6)] == [x * x for x in range(6)]
        back = [r for r in caplog.records if "backend answers again: pool workers start" in r.getMessage()]
        assert len(back) == 1, caplog.text
        assert "(it refused for " in back[0].getMessage()
        assert back[0].created < slot_wall  # the probe found it answering before the backoff's next try
    finally:
        config.reset()  # (the relay stays up: the backend made for it cleans up through it at exit)


# -- errors that say what to do --------------------------------------------------------------------


@pytest.mark.parametrize(("image", "expected"), [
    ("fiber-test-missing:nope", r"not on the Docker daemon.*docker build"),
    (NOPYTHON_IMAGE, r"has no 'python3'"),
    (NOFIBER_IMAGE, r"has Python but not fiber-core.*build-dists\.sh <build context>/fiber-dist.*COPY fiber-dist/ /tmp/fiber/ "
                    r"and RUN pip install --find-links /tmp/fiber fiber-core"),
])
def test_bad_image(image: str, expected: str, monkeypatch: pytest.MonkeyPatch,
                   docker_api: docker.APIClient) -> None:
    monkeypatch.setenv("FIBER_DOCKER_IMAGE", image)
    since = int(time.time()) - 1
    b = make_backend()
    try:
        with pytest.raises(BackendError, match=expected):
            b.start_job(JobSpec(command=["python3", "-m", "fiber_core.processes.worker"], name="w"))
        with pytest.raises(BackendError, match=expected):  # the same answer, from the cache
            b.start_job(JobSpec(command=["python3", "-m", "fiber_core.processes.worker"], name="w"))
        # A whole Process and a Pool fail at start() too, with the same message.
        with pytest.raises(BackendError, match=expected):
            fiber_core.Process(target=docker_tasks.square, args=(1,), backend="docker", image=image).start()
        with pytest.raises(BackendError, match=expected):
            fiber_core.Pool(2, backend="docker", image=image)
        # The image check's container (--rm) goes away by itself.
        wait_gone(docker_api, {c["Id"] for c in containers(docker_api, f"{LABEL_OWNER}={b.owner}")}, since)
    finally:
        b.cleanup()


def test_no_image_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FIBER_DOCKER_IMAGE")
    b = make_backend()
    assert not b.in_container  # this test runs on the daemon's host
    with pytest.raises(BackendError, match="set FIBER_DOCKER_IMAGE"):
        b.start_job(sleeper())


def test_unreachable_daemon(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    sock = tmp_path / "no-docker.sock"
    monkeypatch.setenv("DOCKER_HOST", f"unix://{sock}")
    b = make_backend()
    with pytest.raises(BackendError, match=f"cannot reach the Docker daemon at unix://{sock} "
                                           r"\(from DOCKER_HOST\).*Start Docker"):
        b.start_job(sleeper())
    # What a user sees: FIBER_BACKEND=docker python app.py, without a daemon.
    line, _ = failing_program(tmp_path, {**os.environ, "FIBER_BACKEND": "docker"}, timeout=WAIT)
    assert line.startswith(f"fiber_core.base.errors.BackendError: cannot reach the Docker daemon at "
                           f"unix://{sock} (from DOCKER_HOST)"), line
    with pytest.raises(BackendError, match="FIBER_DOCKER_BASE_URL"):
        make_backend(base_url="tcp://127.0.0.1:9").start_job(sleeper())
    with pytest.raises(BackendError, match="cannot reach the Docker daemon"):
        DockerBackend.clean({"base_url": f"unix://{sock}"}, "r")


# -- Process, Queue and Pool in containers ---------------------------------------------------------


def test_process_exit_codes() -> None:
    p = fiber_core.Process(target=docker_tasks.exit_with, args=(3,), backend="docker")
    p.start()
    p.join(WAIT)
    assert p.exitcode == 3
    p = fiber_core.Process(target=docker_tasks.fail, args=(1,), backend="docker")
    p.start()
    p.join(WAIT)
    assert p.exitcode == 1
    q = fiber_core.Queue()
    p = fiber_core.Process(target=docker_tasks.sleep_forever, args=(q,), backend="docker")
    p.start()
    assert q.get(timeout=WAIT) == "up"
    assert p.is_alive()
    p.terminate()
    p.join(WAIT)
    assert p.exitcode == -signal.SIGTERM


def test_a_process_starts_on_a_spare_container(docker_api: docker.APIClient) -> None:
    # Docker keeps one spare by default: after a start, the next runs in a container started ahead.
    from fiber_core.processes import spares
    from fiber_core.runtime.run import runtime

    def run_one(code: int) -> tuple[fiber_core.Process, str]:
        q = fiber_core.Queue()
        p = fiber_core.Process(target=docker_tasks.container_of, args=(q, code), backend="docker")
        p.start()
        host = q.get(timeout=WAIT)
        p.join(WAIT)
        assert p.exitcode == code
        return p, host

    spares.release(WAIT)
    since = int(time.time())
    first, host = run_one(0)
    assert first.job.id == host
    assert spares.settle(WAIT)
    (spare,) = spares.ready_jobs()
    info = docker_api.inspect_container(spare.id)
    assert info["State"]["Running"] and info["Config"]["Labels"]["fiber.name"] == "spare"
    p, host = run_one(4)
    assert host != first.job.id
    assert p.job is spare and spare.id == host  # the container that was ready ran it
    assert spares.settle(WAIT)
    (again,) = spares.ready_jobs()
    spares.release(WAIT)  # let go: the container's worker exits 0 and is removed (--rm)
    assert runtime().get_backend("docker").wait_for_job(again, WAIT) == 0
    wait_gone(docker_api, {first.job.id, spare.id, again.id}, since)


def test_the_runs_key_is_not_in_the_containers_config(docker_api: docker.APIClient) -> None:
    # It travels on the container's stdin: `docker inspect` (and the daemon's API) do not show it.
    from fiber_core.runtime.run import runtime

    key = runtime().authkey.hex()
    q = fiber_core.Queue()
    p = fiber_core.Process(target=docker_tasks.sleep_forever, args=(q,), backend="docker")
    p.start()
    assert q.get(timeout=WAIT) == "up"  # the job authenticated with the key it read on stdin
    info = docker_api.inspect_container(p.job.id)
    assert key not in repr(info)
    env = dict(e.split("=", 1) for e in info["Config"]["Env"])
    assert "FIBER_AUTHKEY" not in env and "FIBER_PROCESS_TOKEN" not in env
    assert info["Config"]["OpenStdin"] is True and info["Config"]["Cmd"][:2] == ["/bin/sh", "-c"]
    p.terminate()
    p.join(WAIT)
    assert p.exitcode == -signal.SIGTERM


def test_the_programs_environment_reaches_a_job_less_what_is_denied_and_a_marked_secret_stays_hidden(
        docker_api: docker.APIClient, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "s3cr3t-" + secrets.token_hex(8)
    monkeypatch.setenv("FIBERTEST_PASSED", "passed")
    monkeypatch.setenv("FIBERTEST_EXCLUDED", "excluded")
    monkeypatch.setenv("FIBERTEST_SECRET", secret)
    monkeypatch.setenv("TERM", "fibertest-term")  # this machine's terminal: denied
    names = ["FIBERTEST_PASSED", "FIBERTEST_EXCLUDED", "FIBERTEST_SECRET", "FIBERTEST_ADDED", "TERM"]
    q = fiber_core.Queue()
    p = fiber_core.Process(target=docker_tasks.report_environ, args=(q, names), backend="docker",
                           env={"FIBERTEST_ADDED": "added"}, env_exclude=["FIBERTEST_EXCL*"],
                           secret_env=["FIBERTEST_SECRET"])
    p.start()
    seen = q.get(timeout=WAIT)
    assert seen["FIBERTEST_PASSED"] == "passed" and seen["FIBERTEST_ADDED"] == "added"
    assert seen["FIBERTEST_SECRET"] == secret  # the task sees it...
    assert seen["FIBERTEST_EXCLUDED"] is None and seen["TERM"] != "fibertest-term"
    info = docker_api.inspect_container(p.job.id)
    assert secret not in repr(info)  # ...docker inspect does not
    env = dict(e.split("=", 1) for e in info["Config"]["Env"])
    assert env["FIBERTEST_PASSED"] == "passed" and "FIBERTEST_SECRET" not in env and "TERM" not in env
    p.terminate()
    p.join(WAIT)
    assert p.exitcode == -signal.SIGTERM

    with fiber_core.Pool(1, backend="docker", env={"FIBERTEST_PASSED": "per pool"}) as pool:  # a job's own choice
        assert pool.map(docker_tasks.getenv, ["FIBERTEST_PASSED", "FIBERTEST_EXCLUDED"]) == ["per pool", "excluded"]


def test_queues() -> None:
    inbox, outbox = fiber_core.Queue(), fiber_core.Queue()
    p = fiber_core.Process(target=docker_tasks.echo_squares, args=(inbox, outbox), backend="docker")
    p.start()
    for x in range(20):
        inbox.put(x)
    inbox.put(None)
    got = [outbox.get(timeout=WAIT) for _ in range(20)]
    p.join(WAIT)
    assert p.exitcode == 0
    assert [(x, sq) for x, sq, _ in got] == [(x, x * x) for x in range(20)]
    assert {init for _, _, init in got} == {"/sbin/docker-init"}

    jq, results = fiber_core.JoinableQueue(), fiber_core.Queue()
    p = fiber_core.Process(target=docker_tasks.consume, args=(jq, results), backend="docker")
    p.start()
    for x in range(10):
        jq.put(x)
    jq.join()  # every item marked done by the container
    assert sorted(results.get(timeout=WAIT) for _ in range(10)) == list(range(1, 11))
    jq.put(None)
    p.join(WAIT)
    assert p.exitcode == 0


def test_pool() -> None:
    with fiber_core.Pool(3, backend="docker") as pool:
        out = pool.map(docker_tasks.where, range(30))
        assert [x for x, _, _ in out] == list(range(30))
        assert {init for _, init, _ in out} == {"/sbin/docker-init"}  # every task ran in a container
        assert {cwd for _, _, cwd in out} == {os.getcwd()}
        assert sorted(pool.imap_unordered(docker_tasks.square, range(50))) == [x * x for x in range(50)]
        assert pool.apply_async(docker_tasks.square, (7,)).get(WAIT) == 49
        assert pool.starmap(pow, [(2, 3), (3, 2)]) == [8, 9]
        with pytest.raises(ValueError, match="bad item 3") as e:
            pool.map(docker_tasks.fail, [3])
        assert "docker_tasks.py" in str(e.value.__cause__)  # the remote traceback


@pytest.mark.skipif(sys.version_info[:2] != (3, 11),
                    reason="the test image runs Python 3.11: code sent by value needs the same version")
def test_broadcast_versions_reach_containers_in_order() -> None:
    b = fiber_core.broadcast(bytes([1]) * 1_000_000)
    with fiber_core.Pool(2, backend="docker") as pool:
        first = pool.map(docker_tasks.read_broadcast, [b] * 6, chunksize=1)
        assert {(v, tuple(values)) for v, values, _, _ in first} == {(1, (1,))}
        readers = {token for *_, token in first}
        # a container has a /dev/shm of its own: each fetched its copy once
        assert b.fetches == len(readers) and all(shared for _, _, shared, _ in first)
        b.publish(bytes([2]) * 1_000_000)
        second = pool.map(docker_tasks.read_broadcast, [b] * 6, chunksize=1)
        assert {(v, tuple(values)) for v, values, _, _ in second} == {(2, (2,))}


def test_pool_functions_by_value() -> None:
    factor = 3
    with fiber_core.Pool(2, backend="docker") as pool:
        assert pool.map(lambda x: x * factor, range(5)) == [0, 3, 6, 9, 12]  # no import needed


def test_pool_recovers_when_a_container_is_killed(docker_api: docker.APIClient) -> None:
    items = list(range(40))
    with fiber_core.Pool(2, backend="docker") as pool:
        it = pool.imap(docker_tasks.slow_square, items, chunksize=1)
        assert next(it) == 0  # both workers are up and running tasks back to back
        victim = pool._pool[0]
        docker_api.kill(victim.job.id)  # from outside, as the OOM killer or an operator would
        assert [0, *it] == [x * x for x in items]  # every result, once, in order
        victim.join(WAIT)
        assert victim.exitcode == -signal.SIGKILL
        deadline = time.monotonic() + WAIT  # the pool replaces the worker it lost
        while victim in pool._pool or len(pool._pool) < 2:
            assert time.monotonic() < deadline, "the pool did not replace its killed worker"
            time.sleep(0.05)
        assert pool.map(docker_tasks.square, range(10)) == [x * x for x in range(10)]
    assert not [c for c in docker_api.containers(all=True) if c["Id"] == victim.job.id]


# -- nothing left behind ------------------------------------------------------------------------------

# The parents' functions live in a module next to them, imported by reference (found in
# the mounted working directory): by value, they would need the image's Python version.
PARENT_TASKS = """
import time


def work(x):
    time.sleep(x)
    return x


def hold(q):
    q.put("up")
    time.sleep(3600)
"""

PARENT = """
import sys
import fiber_core
from fiber_core.processes import spares
from fiber_core.runtime.run import runtime
from parent_tasks import hold, work

if __name__ == "__main__":
    pool = fiber_core.Pool(2)
    assert pool.map(work, [0.0] * 4) == [0.0] * 4
    q = fiber_core.Queue()
    p = fiber_core.Process(target=hold, args=(q,))
    p.start()
    assert q.get(timeout=120) == "up"
    busy = pool.map_async(work, [3600] * 4)
    assert spares.settle(120)  # the spare container started after the process is up too
    print("ready", runtime().run_id, flush=True)
    sys.stdin.read()
"""


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        assert left > 0, "the parent did not get ready in time"
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 1)
            assert chunk, f"the parent exited ({proc.wait()}): {proc.stderr.read().decode()}"
            line += chunk
    return line.decode()


def test_parent_killed_leaves_no_container(tmp_path: Path, docker_api: docker.APIClient) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    (tmp_path / "parent_tasks.py").write_text(PARENT_TASKS)
    env = {**os.environ, "FIBER_BACKEND": "docker", "PYTHONPATH": ""}
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        word, run_id = _read_line(proc, WAIT).split()
        assert word == "ready"
        ids = {c["Id"] for c in containers(docker_api, f"{LABEL_RUN}={run_id}")}
        assert len(ids) >= 4  # two pool workers, one process, its spare (and maybe a finished image check)
        since = int(time.time()) - 1
        proc.kill()
        proc.wait(WAIT)
        wait_gone(docker_api, ids, since)  # each worker saw its parent go and ended; --rm did the rest
        assert containers(docker_api, f"{LABEL_RUN}={run_id}") == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_parent_exits_normally_or_raises_leaves_no_container(tmp_path: Path,
                                                            docker_api: docker.APIClient) -> None:
    (tmp_path / "parent_tasks.py").write_text(PARENT_TASKS)
    for ending, status in (("pass", 0), ("raise SystemExit(3)", 3), ("raise RuntimeError('boom')", 1)):
        script = tmp_path / "parent.py"
        script.write_text(textwrap.dedent(f"""
            import fiber_core
            from fiber_core.contract.backend import JobSpec
            from fiber_core.runtime.run import runtime
            from parent_tasks import hold

            if __name__ == "__main__":
                print(runtime().run_id, flush=True)
                # A job that does not end with its parent: only the backend's cleanup removes it.
                runtime().backend.start_job(JobSpec(["python3", "-c", "import time; time.sleep(600)"]))
                q = fiber_core.Queue()
                p = fiber_core.Process(target=hold, args=(q,), daemon=True)
                p.start()
                pool = fiber_core.Pool(2)
                assert pool.map(abs, [-1, -2]) == [1, 2]
                assert q.get(timeout=120) == "up"
                {ending}
        """))
        out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                             env={**os.environ, "FIBER_BACKEND": "docker"}, timeout=WAIT)
        assert out.returncode == status, out.stderr
        assert "could not remove" not in out.stderr
        run_id = out.stdout.split()[0]
        assert containers(docker_api, f"{LABEL_RUN}={run_id}") == [], ending


def test_sigterm_to_the_parent_leaves_no_container(tmp_path: Path, docker_api: docker.APIClient) -> None:
    (tmp_path / "parent_tasks.py").write_text(PARENT_TASKS)
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import time
        import fiber_core
        from fiber_core.contract.backend import JobSpec
        from fiber_core.runtime.run import runtime
        from parent_tasks import hold

        if __name__ == "__main__":
            # A job that does not end with its parent: only the backend's cleanup removes it.
            runtime().backend.start_job(JobSpec(["python3", "-c", "import time; time.sleep(600)"]))
            q = fiber_core.Queue()
            p = fiber_core.Process(target=hold, args=(q,))  # not daemonic: stopped, not waited for
            p.start()
            assert q.get(timeout=120) == "up"
            print(runtime().run_id, flush=True)
            time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "FIBER_BACKEND": "docker"})
    try:
        ready, _, _ = select.select([proc.stdout], [], [], WAIT)
        assert ready, "the program did not start its jobs"
        run_id = proc.stdout.readline().strip()
        assert run_id, proc.stderr.read()
        # The job and the process's; a spare job may have started after the process too.
        names = [c["Names"][0] for c in containers(docker_api, f"{LABEL_RUN}={run_id}")]
        assert len([n for n in names if not n.endswith("-spare")]) == 2, names
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGTERM, err
    assert "could not remove" not in err and "Traceback" not in err, err
    assert containers(docker_api, f"{LABEL_RUN}={run_id}") == []


def test_clean_removes_what_a_crashed_run_left(docker_api: docker.APIClient) -> None:
    b = make_backend()
    jobs = [b.start_job(sleeper(f"left{i}")) for i in range(2)]
    for job in jobs:
        wait_output(b, job, "up")
    other = make_backend()  # another run: clean --run must not touch it
    keep = other.start_job(sleeper("keep"))
    try:
        # As if b's process had crashed: nothing calls b.cleanup().
        removed = DockerBackend.clean(b.settings, b.run_id)
        assert len(removed) == 2 and all(b.run_id in r for r in removed)
        assert containers(docker_api, f"{LABEL_RUN}={b.run_id}") == []
        assert other.poll_job(keep) is None
        left = other.start_job(sleeper("left"))
        wait_output(other, left, "up")
        out = subprocess.run([sys.executable, "-m", "fiber_core.cli", "clean", "--backend", "docker",
                              "--run", other.run_id], capture_output=True, text=True, timeout=WAIT)
        assert out.returncode == 0, out.stderr
        assert f"2 leftover(s) of run {other.run_id} removed from docker" in out.stdout
        assert containers(docker_api, f"{LABEL_RUN}={other.run_id}") == []
    finally:
        b.cleanup()
        other.cleanup()


# -- a parent that itself runs in a container --------------------------------------------------------

def _site_for_container(target: Path) -> None:
    """The docker SDK and fiber-docker, copied where a container can mount them."""
    import shutil

    for dist in ("docker", "requests", "urllib3", "idna", "certifi", "charset-normalizer"):
        d = importlib.metadata.distribution(dist)
        for f in d.files or ():
            src = Path(d.locate_file(f))
            if src.is_file() and "__pycache__" not in src.parts and not str(f).startswith(".."):
                dst = target / f
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
    pkg = Path(importlib.import_module("fiber_docker").__file__).parent  # type: ignore[arg-type]
    shutil.copytree(pkg, target / "fiber_docker", ignore=shutil.ignore_patterns("__pycache__"))
    info = target / "fiber_docker-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fiber-docker\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[fiber]\ndocker = fiber_docker.plugin\n")



def test_parent_in_a_container_uses_its_own_image_and_network(
        tmp_path: Path, docker_host: str, docker_api: docker.APIClient) -> None:
    site = tmp_path / "site"
    _site_for_container(site)
    (tmp_path / "app.py").write_text(textwrap.dedent("""
        import fiber_core
        from fiber_core.runtime.run import runtime


        def whoami(x):
            with open("/proc/1/cmdline", "rb") as f:
                return x, f.read().split(b"\\0")[0].decode()


        if __name__ == "__main__":
            b = runtime().get_backend("docker")
            with fiber_core.Pool(2, backend="docker") as pool:
                print("results", pool.map(whoami, range(4)), flush=True)
            print("in_container", b.in_container, b._network_mode().split(":")[0], flush=True)
    """))
    run_id = "t" + secrets.token_hex(4)
    sock = docker_host.removeprefix("unix://")
    tag = f"fiber-test-parent:{run_id}"
    docker_api.tag(IMAGE, "fiber-test-parent", run_id)  # a name only the parent's container has
    image_id = docker_api.inspect_image(IMAGE)["Id"]
    parent = docker_api.create_container(
        tag, command=["python3", "/app/app.py"], working_dir="/app",
        environment={"PYTHONPATH": "/site", "DOCKER_HOST": "unix:///var/run/docker.sock",
                     "FIBER_RUN_ID": run_id},
        labels={"fiber.test": "parent-in-container"},
        host_config=docker_api.create_host_config(
            network_mode="none",  # its workers can reach it only by sharing its network namespace
            binds=[f"{sock}:/var/run/docker.sock", f"{site}:/site:ro", f"{tmp_path}:/app:ro"],
            init=True))["Id"]
    try:
        since = int(time.time()) - 1
        docker_api.start(parent)
        status = docker_api.wait(parent, timeout=WAIT)["StatusCode"]
        logs = docker_api.logs(parent).decode()
        assert status == 0, logs
        assert "results [(0, '/sbin/docker-init'), (1, '/sbin/docker-init'), (2, '/sbin/docker-init'), " \
               "(3, '/sbin/docker-init')]" in logs
        assert "in_container True container" in logs
        created = docker_api.events(since=since, until=int(time.time()) + 1, decode=True,
                                    filters={"type": ["container"], "event": ["create"],
                                             "label": [f"{LABEL_RUN}={run_id}"]})
        images = {e["Actor"]["Attributes"]["image"] for e in created}
        assert images == {image_id}, images  # the workers (and the image check) ran the parent's image
        assert containers(docker_api, f"{LABEL_RUN}={run_id}") == []
    finally:
        docker_api.remove_container(parent, force=True)
        docker_api.remove_image(tag)


# -- the pool on lost containers --------------------------------------------------------------------


def test_pool_task_over_the_memory_limit_fails_naming_memory_after_one_run() -> None:
    runs = fiber_core.Queue()
    with fiber_core.Pool(1, backend="docker", memory=64) as pool:
        res = pool.apply_async(docker_tasks.allocate, (256, runs))
        with pytest.raises(TaskLostError, match=r"apply_async\(allocate, .*out of memory, limit 64 MiB"):
            res.get(timeout=WAIT)
        # Once in a batch not watched (uncharged), then once watched: an out-of-memory kill
        # is not retried by default (the Pool's charges, as tests/test_pool.py states them).
        assert [runs.get(timeout=WAIT) for _ in range(2)] == ["ran", "ran"]
        assert runs.empty()
        assert pool.apply_async(docker_tasks.square, (4,)).get(timeout=WAIT) == 16


def test_pool_task_that_sigkills_its_worker_is_charged_as_a_kill_not_as_perhaps_out_of_memory() -> None:
    with fiber_core.Pool(1, backend="docker") as pool:
        res = pool.apply_async(docker_tasks.sigkill_own_worker)
        # Each death is KILLED (OOMKilled false), so it draws on MAX_TASK_KILLS, not on
        # task_losses (3) as a SIGKILL that may be an out-of-memory kill would.
        with pytest.raises(TaskLostError, match=rf"apply_async\(sigkill_own_worker, \(\)\).*killed by SIGKILL "
                                                rf"{MAX_TASK_KILLS} times while running it, never by the "
                                                "out-of-memory killer"):
            res.get(timeout=WAIT)
        assert pool.apply_async(docker_tasks.square, (4,)).get(timeout=WAIT) == 16


def test_pool_worker_stopped_by_docker_stop_hands_its_work_back(docker_api: docker.APIClient) -> None:
    items = list(range(30))
    with fiber_core.Pool(2, backend="docker") as pool:
        it = pool.imap(docker_tasks.slow_square, items, chunksize=1)
        assert next(it) == 0  # both workers are up and running tasks
        victim = pool._pool[0]
        docker_api.stop(victim.job.id, timeout=60)  # SIGTERM; SIGKILL only after 60 s
        victim.join(WAIT)
        assert victim.exitcode == 0  # it finished its task and left, before any SIGKILL
        assert [0, *it] == [x * x for x in items]  # every result, once, in order
        assert pool.map(docker_tasks.square, range(10)) == [x * x for x in range(10)]


@pytest.mark.timeout(600)
def test_pool_map_under_docker_stops_charges_no_task(docker_api: docker.APIClient) -> None:
    """A random worker container stopped (`docker stop -t 2`: SIGTERM, SIGKILL 2 s later) every
    0.5-1 s during a map: every result exactly once and in order, and no task charged
    (``task_losses=1``: one charged death fails the map)."""
    import random

    n = 6000
    rng = random.Random(3)
    stop = threading.Event()
    stopped: list[str] = []

    def preempt(pool: fiber_core.Pool) -> None:
        while not stop.wait(rng.uniform(0.5, 1.0)):
            with pool._lock:
                ids = [w.process.job.id for w in pool._workers.values()
                       if w.ready and not w.lost and not w.draining and w.process.job is not None]
            if not ids:
                continue
            cid = rng.choice(ids)
            # docker stop blocks for the grace period: from a thread of its own
            threading.Thread(target=_stop_quietly, args=(docker_api, cid), daemon=True).start()
            stopped.append(cid)

    with fiber_core.Pool(4, backend="docker", task_losses=1) as pool:
        thread = threading.Thread(target=preempt, args=(pool,), daemon=True)
        thread.start()
        try:
            out = pool.map(docker_tasks.ms_task, range(n), chunksize=5)
        finally:
            stop.set()
            thread.join(WAIT)
        assert out == list(range(n))
        assert pool.map(docker_tasks.square, range(8)) == [x * x for x in range(8)]
    assert stopped, "no worker container was stopped during the map"


def _stop_quietly(api: docker.APIClient, cid: str) -> None:
    try:
        api.stop(cid, timeout=2)
    except docker.errors.APIError:
        pass  # it ended meanwhile
