"""fiber-aws against moto, a real AWS emulator served over HTTP on 127.0.0.1.

Nothing here is mocked: boto3 talks HTTP to ``moto_server`` (started by
``scripts/services/moto.sh``), and moto runs every Batch job as a real container
on the project's private dockerd (``scripts/services/docker.sh``) with host
networking, so the jobs reach this process on 127.0.0.1 and a fiber Process or
Pool of Batch jobs really computes. The test VPC is 127.0.0.0/16: as moto runs
them, the jobs' network is this machine's loopback.

Start the services first: ``bash scripts/test-services.sh up docker moto``.

Where moto cannot report what AWS Batch would, the test is overridden with the
reason (see ``MOTO_KILLS``), and the fact is read from the container instead.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import boto3
import docker
import fiber_core
import pytest
from aws_helpers import (
    CPU_QUEUE,
    FAR_QUEUE,
    GPU_QUEUES,
    IMAGE,
    REGION,
    SERVICES,
    SPOT_QUEUE,
    WAIT,
    ensure_infrastructure,
    read_env,
)
from fiber_core.contract import Backend, BackendError, ConfigError, EndReason, Job, JobSpec
from fiber_core.runtime.config import config, create_backend, listen_host, plugins
from fiber_core.testing import BackendConformance, failing_program

from fiber_aws.backend import AwsBatchBackend

MOTO_KILLS = (
    "moto stops a terminated Batch job with `docker kill` (SIGKILL, exit status 137) at once, "
    "where AWS Batch sends SIGTERM first (ECS StopTask, then SIGKILL after the stop timeout): "
    "the job reports -9 instead of -15. test_terminate_as_moto_reports checks what moto does."
)

_docker: docker.DockerClient | None = None


def _moto_api(endpoint: str, path: str, body: dict | None = None) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    data = json.dumps(body).encode() if body is not None else None
    opener.open(urllib.request.Request(endpoint + path, data=data, method="POST"), timeout=10).read()


@pytest.fixture(scope="module", autouse=True)
def moto() -> Iterator[str]:
    """The moto endpoint, with this module's environment: fake credentials, [aws] settings."""
    global _docker
    env = read_env(SERVICES / "moto" / "env")
    if "FIBER_MOTO_ENDPOINT" not in env:
        pytest.fail(f"moto is not running ({SERVICES}/moto/env is missing): "
                    "bash scripts/test-services.sh up docker moto")
    endpoint = env["FIBER_MOTO_ENDPOINT"]
    _docker = docker.DockerClient(base_url=env["DOCKER_HOST"], timeout=60)
    try:
        _docker.ping()
        _docker.images.get(IMAGE)
    except docker.errors.DockerException as e:
        pytest.fail(f"the private dockerd at {env['DOCKER_HOST']} has no {IMAGE} ({e}): "
                    "bash scripts/test-services.sh up docker")
    mp = pytest.MonkeyPatch()
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION",
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                "FIBER_LISTEN_HOST", "FIBER_BACKEND"):
        mp.delenv(var, raising=False)
    no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1,localhost"]))
    for key, value in {
        # boto3's standard chain finds these; nothing may ask an instance metadata service.
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": "/nonexistent/aws-config",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
        "NO_PROXY": no_proxy, "no_proxy": no_proxy,
        "FIBER_AWS_ENDPOINT_URL": endpoint, "FIBER_AWS_REGION": REGION,
        "FIBER_AWS_QUEUE": CPU_QUEUE, "FIBER_AWS_IMAGE": IMAGE, "FIBER_AWS_POLL_INTERVAL": "0.2",
        "FIBER_AWS_GPU_QUEUES": ",".join(f"{t}:{q}" for t, (q, _) in GPU_QUEUES.items()),
        # moto runs a job without the secrets its job definition names: the jobs that must
        # reach this process get the key in their environment (test_the_runs_key_* check ssm).
        "FIBER_AWS_KEY_FROM": "environment",
    }.items():
        mp.setenv(key, value)
    ensure_infrastructure(endpoint)
    yield endpoint
    mp.undo()


@pytest.fixture
def batch(moto: str):  # noqa: ANN201 - a boto3 client
    return boto3.client("batch", region_name=REGION, endpoint_url=moto)


def make_backend(run_id: str | None = None, **overrides: object) -> AwsBatchBackend:
    """A backend built by hand, with the settings Fiber resolves (this module's FIBER_AWS_*) and ``overrides``."""
    plugins().get_class("aws-batch")  # loads the plugin, so the configuration knows its options
    settings = {**config.backend_settings(AwsBatchBackend.settings_section()), **overrides}
    return AwsBatchBackend(settings, run_id or "t" + secrets.token_hex(4))


@pytest.fixture
def aws() -> Iterator[AwsBatchBackend]:
    b = make_backend()
    try:
        yield b
    finally:
        b.cleanup()


def container_of(backend: AwsBatchBackend, job: Job):  # noqa: ANN201 - a docker Container
    """The container moto runs for ``job`` (it names it JOBNAME-JOBID), or None before it exists."""
    try:
        return _docker.containers.get(f"{job.handle.job_name}-{job.id}")
    except docker.errors.NotFound:
        return None


def wait_output(backend: AwsBatchBackend, job: Job, marker: str) -> None:
    """Wait until the job's container has printed ``marker``.

    moto copies a job's output to CloudWatch Logs only when its container exits, so a
    running job's output is read from the container itself, on the private dockerd.
    """
    deadline = time.monotonic() + WAIT
    while True:
        c = container_of(backend, job)
        try:
            if c is not None and marker in c.logs().decode(errors="replace"):
                return
        except docker.errors.NotFound:
            pass
        assert backend.poll_job(job) is None, backend.get_job_logs(job)
        assert time.monotonic() < deadline, "job did not start in time"
        time.sleep(0.05)


def describe(batch, job_id: str) -> dict:  # noqa: ANN001
    return batch.describe_jobs(jobs=[job_id])["jobs"][0]


def wait_batch_status(batch, job_id: str, statuses: tuple[str, ...]) -> dict:  # noqa: ANN001
    """Wait until Batch reports one of ``statuses`` for the job (seen from outside fiber)."""
    deadline = time.monotonic() + WAIT
    while True:
        d = describe(batch, job_id)
        if d["status"] in statuses:
            return d
        assert time.monotonic() < deadline, f"job {job_id} stayed {d['status']}"
        time.sleep(0.1)


def sleeper(name: str = "sleeper") -> JobSpec:
    return JobSpec(command=["python3", "-c", "import time; print('up', flush=True); time.sleep(300)"],
                   name=name)


# -- the shared conformance suite ------------------------------------------------------


class TestAwsBatch(BackendConformance):
    backend_name = "aws-batch"
    python = "python3"
    start_timeout = WAIT

    def wait_running(self, backend: Backend, job: Job, marker: str) -> None:
        wait_output(backend, job, marker)  # type: ignore[arg-type]

    @pytest.mark.xfail(strict=True, reason=MOTO_KILLS)
    def test_terminate(self, backend: Backend) -> None:
        super().test_terminate(backend)

    def test_terminate_as_moto_reports(self, backend: AwsBatchBackend, batch) -> None:  # noqa: ANN001
        job = backend.start_job(sleeper())
        self.wait_running(backend, job, "up")
        backend.terminate_job(job)
        assert self.wait(backend, job) == -signal.SIGKILL  # moto: docker kill, exit status 137
        d = describe(batch, job.id)
        assert d["status"] == "FAILED"
        assert d["statusReason"] == f"fiber: terminated by its parent (run {backend.run_id})"
        assert "was terminated by fiber" in backend.get_job_logs(job)
        assert job.state.reason is EndReason.STOPPED

    def test_jobs_run_with_host_network_only(self, backend: AwsBatchBackend) -> None:
        job = backend.start_job(sleeper())
        self.wait_running(backend, job, "up")
        attrs = container_of(backend, job).attrs
        assert attrs["HostConfig"]["NetworkMode"] == "host"
        assert list(attrs["NetworkSettings"]["Networks"]) == ["host"]
        backend.terminate_job(job)

    def test_one_poller_and_batched_describe_jobs(self, backend: AwsBatchBackend) -> None:
        calls: list[tuple[str, list[str]]] = []

        def record(params: dict, **_: object) -> None:
            calls.append((threading.current_thread().name, list(params.get("jobs", []))))

        backend.batch.meta.events.register("before-parameter-build.batch.DescribeJobs", record)
        backend.describe_batch = 2  # AWS takes 100 ids a call; 2 shows the batching with 5 jobs
        jobs = [backend.start_job(sleeper(f"batched-{i}")) for i in range(5)]
        for job in jobs:
            self.wait_running(backend, job, "up")
        for _ in range(200):
            assert all(backend.poll_job(job) is None for job in jobs)
        pollers = [t for t in threading.enumerate() if t.name == f"fiber-aws-batch-poller-{backend.run_id}"]
        assert len(pollers) == 1
        seen = list(calls)
        assert seen and all(name == pollers[0].name for name, _ in seen)
        assert all(1 <= len(ids) <= 2 for _, ids in seen)
        assert {job.id for job in jobs} <= {i for _, ids in seen for i in ids}
        backend.cleanup()
        for job in jobs:
            assert backend.wait_for_job(job, WAIT) is not None


# -- hardware routing --------------------------------------------------------------------


def _requirements(batch, job_id: str) -> tuple[dict, dict[str, str]]:  # noqa: ANN001
    d = describe(batch, job_id)
    jd = batch.describe_job_definitions(jobDefinitions=[d["jobDefinition"]])["jobDefinitions"][0]
    return d, {r["type"]: r["value"] for r in jd["containerProperties"]["resourceRequirements"]}


def test_gpu_process_runs_on_the_queue_of_its_gpu_type(batch) -> None:  # noqa: ANN001
    @fiber_core.meta(gpu=1, gpu_type="a10g", memory=1024)
    def on_gpu(q) -> None:  # noqa: ANN001
        import os

        q.put(os.environ["AWS_BATCH_JOB_ID"])

    q = fiber_core.Queue()
    p = fiber_core.Process(target=on_gpu, args=(q,), backend="aws-batch")
    p.start()
    try:
        assert q.get(timeout=WAIT) == p.job.id  # it ran, as that Batch job
        p.join(WAIT)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()
    d, reqs = _requirements(batch, p.job.id)
    assert d["jobQueue"].endswith(f":job-queue/{GPU_QUEUES['a10g'][0]}")
    assert reqs == {"VCPU": "1", "MEMORY": "1024", "GPU": "1"}


def test_gpu_type_routes_and_cpu_jobs_use_the_default_queue(aws: AwsBatchBackend, batch) -> None:  # noqa: ANN001
    gpu = aws.start_job(JobSpec(command=["python3", "-c", "pass"], name="g", gpu=2, gpu_type="T4", cpu=4))
    cpu = aws.start_job(JobSpec(command=["python3", "-c", "pass"], name="c", cpu=1.5, memory=512))
    assert aws.wait_for_job(gpu, WAIT) == 0
    assert aws.wait_for_job(cpu, WAIT) == 0
    d, reqs = _requirements(batch, gpu.id)
    assert d["jobQueue"].endswith(f":job-queue/{GPU_QUEUES['t4'][0]}")
    assert reqs == {"VCPU": "4", "MEMORY": "2048", "GPU": "2"}
    d, reqs = _requirements(batch, cpu.id)
    assert d["jobQueue"].endswith(f":job-queue/{CPU_QUEUE}")
    assert reqs == {"VCPU": "2", "MEMORY": "512"}


def test_identical_specs_start_as_one_array_job(aws: AwsBatchBackend, batch) -> None:  # noqa: ANN001
    """Three identical specs are one SubmitJob (arrayProperties.size = 3); each child is a Job.

    Where moto falls short: it does not set AWS_BATCH_JOB_ARRAY_INDEX in a child, which
    AWS Batch does, so the command reads the index from AWS_BATCH_JOB_ID (PARENT:INDEX,
    as both set it); and its DescribeJobs gives no child's exit code, which the backend
    then reads from ListJobs (moto lists the children with their queue's jobs).
    """
    submitted: list[dict] = []
    aws.batch.meta.events.register("before-parameter-build.batch.SubmitJob",
                                   lambda params, **_: submitted.append(params))
    code = ("import os, sys; i = os.environ.get('AWS_BATCH_JOB_ARRAY_INDEX') or "
            "os.environ['AWS_BATCH_JOB_ID'].rpartition(':')[2]; sys.exit(3 + int(i))")
    specs = [JobSpec(command=["python3", "-c", code], name="array") for _ in range(3)]
    jobs = aws.start_jobs(specs)
    assert len(submitted) == 1 and submitted[0]["arrayProperties"] == {"size": 3}
    parent = jobs[0].id.rpartition(":")[0]
    assert [job.id for job in jobs] == [f"{parent}:{i}" for i in range(3)]
    assert [job.spec for job in jobs] == specs and aws.jobs == jobs
    assert [aws.wait_for_job(job, WAIT) for job in jobs] == [3, 4, 5]
    assert all(job.state.reason is EndReason.EXITED for job in jobs)
    assert describe(batch, parent)["arrayProperties"]["size"] == 3
    # Specs that differ are submitted one by one.
    other = [JobSpec(command=["python3", "-c", "pass"], name=n) for n in ("a", "b")]
    assert [aws.wait_for_job(job, WAIT) for job in aws.start_jobs(other)] == [0, 0]
    assert len(submitted) == 3 and not any("arrayProperties" in p for p in submitted[1:])


def test_array_child_is_terminated_on_its_own(aws: AwsBatchBackend, batch) -> None:  # noqa: ANN001
    jobs = aws.start_jobs([sleeper("array-sleeper") for _ in range(2)])
    for job in jobs:
        wait_batch_status(batch, job.id, ("RUNNING",))
    aws.terminate_job(jobs[0])
    assert aws.wait_for_job(jobs[0], WAIT) not in (None, 0)
    assert jobs[0].state.reason is EndReason.STOPPED
    assert aws.poll_job(jobs[1]) is None
    aws.terminate_job(jobs[1])
    assert aws.wait_for_job(jobs[1], WAIT) is not None


def test_job_definitions_are_registered_once_and_reused(aws: AwsBatchBackend) -> None:
    a = aws.job_definition(IMAGE, 3, 3000, 0)
    assert aws.job_definition(IMAGE, 3, 3000, 0) == a
    assert aws.job_definition(IMAGE, 3, 3000, 1) != a
    other = make_backend()  # a later run finds it
    assert other.job_definition(IMAGE, 3, 3000, 0) == a
    props = aws.batch.describe_job_definitions(jobDefinitions=[a])["jobDefinitions"][0]["containerProperties"]
    assert props["image"] == IMAGE
    assert props["linuxParameters"] == {"initProcessEnabled": True}


PROGRAM = textwrap.dedent("""
    import fiber_core as multiprocessing
    from fiber_core.runtime.run import runtime


    def simulate(seed):
        return seed * seed


    def train(batch):
        return sum(batch)


    if __name__ == "__main__":
        with multiprocessing.Pool(2) as workers:
            results = workers.map(simulate, range(10))
        with multiprocessing.Pool(1, gpu=1, gpu_type="a10g") as learner:
            print(runtime().run_id, learner.apply(train, (results,)), flush=True)
""")


def test_program_runs_cpu_and_gpu_pools_on_their_queues(batch, tmp_path: Path) -> None:  # noqa: ANN001
    # An unchanged multiprocessing program, FIBER_BACKEND=aws-batch: its listen address
    # comes from the jobs' VPC (127.0.0.0/16 here), its pools' workers are Batch jobs.
    (tmp_path / "app.py").write_text(PROGRAM)
    out = subprocess.run([sys.executable, "app.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=2 * WAIT, env={**os.environ, "FIBER_BACKEND": "aws-batch"})
    assert out.returncode == 0, out.stderr
    run_id, total = out.stdout.split()
    assert int(total) == sum(i * i for i in range(10))
    for queue, n in ((CPU_QUEUE, 2), (GPU_QUEUES["a10g"][0], 1)):
        jobs = batch.list_jobs(jobQueue=queue, filters=[{"name": "JOB_NAME", "values": [f"fiber-{run_id}-*"]}])
        assert len(jobs["jobSummaryList"]) >= n, queue
    # The two workers of Pool(2) went as one array job: one SubmitJob for both.
    summaries = batch.list_jobs(jobQueue=CPU_QUEUE, filters=[{"name": "JOB_NAME", "values": [f"fiber-{run_id}-*"]}])
    described = batch.describe_jobs(jobs=[j["jobId"] for j in summaries["jobSummaryList"]])["jobs"]
    submitted = [d for d in described if ":" not in d["jobId"]]  # moto lists the children too
    assert [(d.get("arrayProperties") or {}).get("size") for d in submitted] == [2], (out.stderr, [
        (d["jobName"], d["jobQueue"], d["status"], d.get("arrayProperties")) for d in described])


OUTAGE_PROGRAM = textwrap.dedent("""
    import json, sys, time
    import fiber_core as multiprocessing


    def square(x):
        return x * x


    if __name__ == "__main__":
        with multiprocessing.Pool(2) as pool:
            first = pool.map(square, range(10))
            started = [p.job.id for p in pool._pool]
            print(json.dumps(started), flush=True)
            sys.stdin.readline()  # the API goes away and a worker is terminated meanwhile
            rest = pool.map(square, range(10, 400), chunksize=1)
            assert first + rest == [x * x for x in range(400)]
            print("exact", flush=True)
            sys.stdin.readline()  # the API is back: the lost worker's replacement starts
            deadline = time.monotonic() + 120
            new = []
            while not new and time.monotonic() < deadline:
                new = [p.job.id for p in pool._pool if p.job is not None and p.job.id not in started]
                time.sleep(0.05)
            print(json.dumps(new), flush=True)
            print(sum(pool.map(square, range(20))), flush=True)
""")


@pytest.mark.timeout(400)
def test_a_program_rides_out_the_batch_api_going_away_and_coming_back(batch, tmp_path: Path) -> None:  # noqa: ANN001
    """The Batch endpoint goes away mid-run (every connection reset, new ones refused), and a
    worker's job is terminated meanwhile: the surviving worker finishes the map exactly, the
    terminated one is seen when the API answers again, a new worker is submitted then, and
    the program ends normally."""
    from urllib.parse import urlsplit

    from fiber_core.testing.outage import Outage

    target = urlsplit(os.environ["FIBER_AWS_ENDPOINT_URL"])
    assert target.hostname is not None and target.port is not None
    (tmp_path / "app.py").write_text(OUTAGE_PROGRAM)
    with Outage(target.hostname, target.port) as api:
        env = {**os.environ, "FIBER_BACKEND": "aws-batch", "FIBER_AWS_ENDPOINT_URL": api.url,
               "FIBER_AWS_API_TIMEOUT": "3"}
        prog = subprocess.Popen([sys.executable, "app.py"], cwd=tmp_path, env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert prog.stdout is not None and prog.stdin is not None
            jobs = json.loads(prog.stdout.readline() or "null")
            assert jobs and len(jobs) == 2, prog.stderr.read() if prog.stderr else ""
            api.cut()
            batch.terminate_job(jobId=jobs[0], reason="host reclaimed while the API was away")
            prog.stdin.write("\n")
            prog.stdin.flush()
            assert prog.stdout.readline().strip() == "exact"
            threading.Event().wait(3.0)  # the rest of the outage, not a synchronisation
            api.restore()
            prog.stdin.write("\n")
            prog.stdin.flush()
            replaced = json.loads(prog.stdout.readline() or "null")
            assert replaced, "no worker replaced the one lost while the API was away"
            assert prog.stdout.readline().strip() == str(sum(x * x for x in range(20)))
            _, err = prog.communicate(timeout=WAIT)
        finally:
            if prog.poll() is None:
                prog.kill()
                prog.communicate()
        assert prog.returncode == 0, err
        assert api.accepted > 0
    described = batch.describe_jobs(jobs=[jobs[0], *replaced])["jobs"]
    assert [d["status"] for d in described][0] == "FAILED"
    assert "host reclaimed while the API was away" in described[0]["statusReason"]


# -- failures that Batch reports, and fiber's own ---------------------------------------


def test_job_terminated_by_someone_else_reports_batch_reason(aws: AwsBatchBackend, batch) -> None:  # noqa: ANN001
    job = aws.start_job(sleeper())
    wait_output(aws, job, "up")
    batch.terminate_job(jobId=job.id, reason="drained by operator for maintenance")
    assert aws.wait_for_job(job, WAIT) not in (None, 0)
    logs = aws.get_job_logs(job)
    assert "FAILED: drained by operator for maintenance" in logs
    assert "up" in logs.splitlines()  # and the job's own output, from CloudWatch Logs
    # moto's docker kill (status 137; AWS Batch sends SIGTERM first): a SIGKILL Fiber did
    # not send and Batch does not call OutOfMemoryError
    assert job.state.reason is EndReason.KILLED
    assert job.state.detail == "drained by operator for maintenance"


def test_image_without_python_fails_with_advice(aws: AwsBatchBackend) -> None:
    job = aws.start_job(JobSpec(command=["python3", "-c", "pass"], name="nopy",
                                image="fiber-test-nopython:latest"))
    try:
        assert aws.wait_for_job(job, WAIT) == 1
        logs = aws.get_job_logs(job)
        assert "FAILED before its container ran" in logs
        assert "check that the image exists" in logs
        assert job.state.reason is EndReason.NEVER_STARTED
    finally:
        c = container_of(aws, job)  # moto leaves a container that could not start
        if c is not None:
            c.remove(force=True)


def test_job_stuck_before_running_is_failed_with_advice(moto: str, batch) -> None:  # noqa: ANN001
    # moto has no capacity model: its state manager holds the job before it starts (in
    # SUBMITTED; real Batch would hold it in RUNNABLE). runnable_timeout counts both.
    _moto_api(moto, "/moto-api/state-manager/set-transition",
              {"model_name": "batch::job", "transition": {"progression": "manual", "times": 2}})
    b = make_backend(runnable_timeout=1.0)
    try:
        job = b.start_job(JobSpec(command=["python3", "-c", "pass"], name="stuck", gpu=1, gpu_type="a10g"))
        assert b.wait_for_job(job, WAIT) == 1
        logs = b.get_job_logs(job)
        assert "without starting: its compute environments have no capacity" in logs
        assert f"on queue {GPU_QUEUES['a10g'][0]}" in logs
        assert "runnable_timeout" in logs
        assert job.state.reason is EndReason.NEVER_STARTED
        assert describe(batch, job.id)["statusReason"].startswith("fiber: no capacity within runnable_timeout=1s")
    finally:
        _moto_api(moto, "/moto-api/state-manager/unset-transition", {"model_name": "batch::job"})
        b.cleanup()
    wait_batch_status(batch, job.id, ("FAILED",))  # the terminated job never runs its command


# -- GPU alternatives: the queues in order -----------------------------------------------

THREE_QUEUES = f"a10g:{GPU_QUEUES['a10g'][0]},t4:{GPU_QUEUES['t4'][0]},l4:{SPOT_QUEUE}"


def test_a_job_the_first_queue_never_runs_moves_to_the_second_and_loses_nothing(moto: str, batch) -> None:  # noqa: ANN001
    # moto has no capacity model: while its state manager holds every new job before it starts
    # (see test_job_stuck_before_running_is_failed_with_advice), the first queue gets no capacity;
    # it is let go once the job has moved, before the second queue's fallback_wait ends.
    show = "import os; print('GOT', os.environ['FIBER_RESOURCES'], flush=True)"
    b = make_backend(gpu_queues=THREE_QUEUES.split(","), fallback_wait=3.0)
    _moto_api(moto, "/moto-api/state-manager/set-transition",
              {"model_name": "batch::job", "transition": {"progression": "manual", "times": 2}})
    try:
        job = b.start_job(JobSpec(command=["python3", "-c", show], name="learner",
                                  gpu_type=["a10g", "t4", ("l4", 2)]))  # type: ignore[arg-type]
        first = job.id
        assert job.handle.queue == GPU_QUEUES["a10g"][0]
        deadline = time.monotonic() + WAIT
        while job.handle.queue == GPU_QUEUES["a10g"][0]:
            assert time.monotonic() < deadline and b.poll_job(job) is None, b.get_job_logs(job)
            time.sleep(0.02)  # the poller moves it: nothing to wait on from here
    finally:
        _moto_api(moto, "/moto-api/state-manager/unset-transition", {"model_name": "batch::job"})
    try:
        assert job.id != first and job.handle.queue == GPU_QUEUES["t4"][0]
        assert b.wait_for_job(job, WAIT) == 0, b.get_job_logs(job)
        line = next(ln for ln in b.get_job_logs(job).splitlines() if ln.startswith("GOT "))
        assert json.loads(line.split(" ", 1)[1])["gpu_type"] == "t4"
        assert describe(batch, job.id)["jobQueue"].endswith(f"/{GPU_QUEUES['t4'][0]}")
        old = wait_batch_status(batch, first, ("FAILED",))  # terminated before it ran: nothing lost
        assert old["statusReason"].startswith("fiber: no capacity within fallback_wait=3s on queue fiber-gpu-a10g")
    finally:
        b.cleanup()


def test_every_alternative_needs_a_queue_before_any_is_submitted(aws: AwsBatchBackend) -> None:
    with pytest.raises(BackendError, match=r"no job queue for GPU type 'h100'"):
        aws.start_job(JobSpec(command=["true"], gpu_type=["a10g", "h100"]))  # type: ignore[arg-type]
    assert aws.jobs == []


def test_a_capacity_kind_goes_to_the_queue_whose_compute_environments_are_of_it(moto: str) -> None:
    show = "import os; print('GOT', os.environ['FIBER_RESOURCES'], flush=True)"
    b = make_backend(queue=f"{CPU_QUEUE},{SPOT_QUEUE}")
    try:
        spot = b.start_job(JobSpec(command=["python3", "-c", show], name="s", capacity="spot"))
        on_demand = b.start_job(JobSpec(command=["python3", "-c", show], name="o", capacity="on-demand"))
        plain = b.start_job(JobSpec(command=["python3", "-c", show], name="p"))
        assert (spot.handle.queue, on_demand.handle.queue, plain.handle.queue) == (SPOT_QUEUE, CPU_QUEUE, CPU_QUEUE)
        for job, kind in ((spot, "spot"), (on_demand, "on-demand")):
            assert b.wait_for_job(job, WAIT) == 0, b.get_job_logs(job)
            line = next(ln for ln in b.get_job_logs(job).splitlines() if ln.startswith("GOT "))
            assert json.loads(line.split(" ", 1)[1])["capacity"] == kind
        with pytest.raises(BackendError, match=rf"no job queue of spot capacity .*{GPU_QUEUES['a10g'][0]} \(on-demand\)"):
            b.start_job(JobSpec(command=["true"], name="g", gpu_type="a10g", capacity="spot"))
    finally:
        b.cleanup()


def test_spot_then_on_demand_moves_a_job_spot_never_runs_to_on_demand(moto: str) -> None:  # noqa: ANN001
    show = "import os; print('GOT', os.environ['FIBER_RESOURCES'], flush=True)"
    b = make_backend(queue=f"{CPU_QUEUE},{SPOT_QUEUE}", fallback_wait=3.0)
    _moto_api(moto, "/moto-api/state-manager/set-transition",
              {"model_name": "batch::job", "transition": {"progression": "manual", "times": 2}})
    try:
        job = b.start_job(JobSpec(command=["python3", "-c", show], name="w", capacity="spot-then-on-demand"))
        assert job.handle.queue == SPOT_QUEUE
        deadline = time.monotonic() + WAIT
        while job.handle.queue == SPOT_QUEUE:
            assert time.monotonic() < deadline and b.poll_job(job) is None, b.get_job_logs(job)
            time.sleep(0.02)  # the poller moves it: nothing to wait on from here
    finally:
        _moto_api(moto, "/moto-api/state-manager/unset-transition", {"model_name": "batch::job"})
    try:
        assert job.handle.queue == CPU_QUEUE
        assert b.wait_for_job(job, WAIT) == 0, b.get_job_logs(job)
        line = next(ln for ln in b.get_job_logs(job).splitlines() if ln.startswith("GOT "))
        assert json.loads(line.split(" ", 1)[1])["capacity"] == "on-demand"
    finally:
        b.cleanup()


HOST_LOSS = "Host EC2 (instance i-0a1b2c3d4e5f60718) terminated."
SPOT_INTERRUPTION = "Your Spot Task was interrupted."


@pytest.mark.parametrize(("queue", "status_reason", "reason"), [
    (CPU_QUEUE, HOST_LOSS, EndReason.HOST_LOST),
    (SPOT_QUEUE, HOST_LOSS, EndReason.PREEMPTED),
    (CPU_QUEUE, SPOT_INTERRUPTION, EndReason.PREEMPTED),
])
def test_lost_host_is_host_lost_or_preempted_by_the_queues_capacity(
        batch, queue: str, status_reason: str, reason: EndReason) -> None:  # noqa: ANN001
    """A job whose instance went away ends HOST_LOST, or PREEMPTED on Spot capacity.

    moto cannot lose a host or reclaim a Spot instance. What it can do is report the
    statusReason AWS Batch gives such a job, verbatim, when the job is terminated with it:
    that is what this test sends (from outside Fiber, as Batch would), on an EC2 and on a
    SPOT compute environment. moto then kills the container (exit status 137), where a
    lost host leaves no exit code or 143; the exit code is not what is tested here.
    """
    b = make_backend(queue=queue)
    try:
        job = b.start_job(sleeper())
        wait_output(b, job, "up")
        batch.terminate_job(jobId=job.id, reason=status_reason)
        assert b.wait_for_job(job, WAIT) not in (None, 0)
        assert job.state.reason is reason
        assert job.state.detail == status_reason
        assert f"FAILED: {status_reason}" in b.get_job_logs(job)
    finally:
        b.cleanup()


# -- parent exit and leftovers ---------------------------------------------------------------


PARENT = textwrap.dedent("""
    import sys
    from fiber_core.contract.backend import JobSpec
    from fiber_core.runtime.run import runtime

    backend = runtime().get_backend("aws-batch")
    job = backend.start_job(JobSpec(
        command=["python3", "-c", "import time; print('up', flush=True); time.sleep(300)"],
        name="left-running"))
    print(job.id, job.handle.job_name, flush=True)
    sys.stdin.readline()  # the test says when to exit; fiber's exit handler cleans up
""")


def test_parent_exit_terminates_its_unfinished_jobs(batch) -> None:  # noqa: ANN001
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        job_id, job_name = parent.stdout.readline().split()
        deadline = time.monotonic() + WAIT
        while True:  # the job's container runs and has printed its marker
            try:
                if "up" in _docker.containers.get(f"{job_name}-{job_id}").logs().decode():
                    break
            except docker.errors.NotFound:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.05)
        parent.stdin.close()
        assert parent.wait(WAIT) == 0
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    d = wait_batch_status(batch, job_id, ("FAILED", "SUCCEEDED"))
    assert d["status"] == "FAILED"
    assert d["statusReason"].startswith("fiber: the parent process exited")


EXECUTION_ROLE = "arn:aws:iam::123456789012:role/fiber-execution"


def test_the_runs_key_is_an_ssm_parameter_not_in_the_job(moto: str, batch) -> None:  # noqa: ANN001
    ssm = boto3.client("ssm", region_name=REGION, endpoint_url=moto)
    key = secrets.token_hex(32)
    b = make_backend(key_from="ssm", execution_role=EXECUTION_ROLE)
    try:
        job = b.start_job(JobSpec(command=["python3", "-c", "pass"], name="keyed",
                                  env={"FIBER_AUTHKEY": key, "FIBER_RUN_ID": b.run_id}))
        described = describe(batch, job.id)
        jobdef = batch.describe_job_definitions(jobDefinitions=[described["jobDefinition"]])["jobDefinitions"][0]
        assert key not in json.dumps(described, default=str) and key not in json.dumps(jobdef, default=str)
        (secret,) = jobdef["containerProperties"]["secrets"]
        assert secret["name"] == "FIBER_AUTHKEY" and secret["valueFrom"].startswith(f"/fiber/{b.run_id}/")
        assert jobdef["containerProperties"]["executionRoleArn"] == EXECUTION_ROLE
        assert ssm.get_parameter(Name=secret["valueFrom"], WithDecryption=True)["Parameter"]["Value"] == key
    finally:
        b.cleanup()
    with pytest.raises(ssm.exceptions.ParameterNotFound):
        ssm.get_parameter(Name=secret["valueFrom"])
    status = batch.describe_job_definitions(jobDefinitions=[jobdef["jobDefinitionArn"]])["jobDefinitions"][0]["status"]
    assert status == "INACTIVE"


def test_a_variable_marked_secret_is_an_ssm_parameter_too(moto: str, batch) -> None:  # noqa: ANN001
    ssm = boto3.client("ssm", region_name=REGION, endpoint_url=moto)
    key, wandb = secrets.token_hex(32), "wandb-" + secrets.token_hex(8)
    b = make_backend(key_from="ssm", execution_role=EXECUTION_ROLE)
    try:
        job = b.start_job(JobSpec(command=["python3", "-c", "pass"], name="keyed", secret_env=("WANDB_API_KEY",),
                                  env={"FIBER_AUTHKEY": key, "WANDB_API_KEY": wandb, "OMP_NUM_THREADS": "4"}))
        described = describe(batch, job.id)
        jobdef = batch.describe_job_definitions(jobDefinitions=[described["jobDefinition"]])["jobDefinitions"][0]
        assert wandb not in json.dumps(described, default=str) and wandb not in json.dumps(jobdef, default=str)
        assert {"name": "OMP_NUM_THREADS", "value": "4"} in described["container"]["environment"]
        refs = {s["name"]: s["valueFrom"] for s in jobdef["containerProperties"]["secrets"]}
        assert set(refs) == {"FIBER_AUTHKEY", "WANDB_API_KEY"}
        assert ssm.get_parameter(Name=refs["WANDB_API_KEY"], WithDecryption=True)["Parameter"]["Value"] == wandb
    finally:
        b.cleanup()
    with pytest.raises(ssm.exceptions.ParameterNotFound):
        ssm.get_parameter(Name=refs["WANDB_API_KEY"])


def test_the_runs_key_needs_an_execution_role_or_says_what_to_set() -> None:
    b = make_backend(key_from="ssm", execution_role=None)
    try:
        with pytest.raises(BackendError, match="execution_role.*FIBER_AWS_EXECUTION_ROLE.*key_from = environment"):
            b.start_job(JobSpec(command=["python3", "-c", "pass"], name="keyed", env={"FIBER_AUTHKEY": "ab"}))
    finally:
        b.cleanup()


def test_fiber_clean_removes_the_key_a_crashed_run_left(moto: str) -> None:
    ssm = boto3.client("ssm", region_name=REGION, endpoint_url=moto)
    b = make_backend(key_from="ssm", execution_role=EXECUTION_ROLE)
    name = b.key_parameter(secrets.token_hex(32))  # then the parent crashed
    removed = AwsBatchBackend.clean(b.settings, b.run_id)
    assert removed == [f"SSM parameter {name}"]
    with pytest.raises(ssm.exceptions.ParameterNotFound):
        ssm.get_parameter(Name=name)


def test_fiber_clean_terminates_a_crashed_runs_jobs(aws: AwsBatchBackend, batch) -> None:  # noqa: ANN001
    job = aws.start_job(sleeper())
    wait_output(aws, job, "up")
    removed = AwsBatchBackend.clean(aws.settings, aws.run_id)
    assert removed == [f"AWS Batch job {job.id} ({job.handle.job_name}, queue {CPU_QUEUE})"]
    assert aws.wait_for_job(job, WAIT) is not None
    assert describe(batch, job.id)["statusReason"] == "fiber clean: left behind by a crashed run"


# -- where the parent listens -------------------------------------------------------------


def test_listen_address_is_this_machines_address_in_the_jobs_vpc(aws: AwsBatchBackend) -> None:
    assert [str(n) for n in aws.job_networks()] == ["127.0.0.0/16"]
    assert aws.get_listen_addr() == "127.0.0.1"


def test_listen_address_outside_the_jobs_vpc_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FIBER_AWS_QUEUE", FAR_QUEUE)
    monkeypatch.setenv("FIBER_AWS_GPU_QUEUES", "")
    b = make_backend("t")
    with pytest.raises(BackendError, match=r"no address in the VPC .*10\.77\.0\.0/16.*listen_host"):
        listen_host(b)
    monkeypatch.setenv("FIBER_LISTEN_HOST", "127.0.0.7")
    assert listen_host(b) == "127.0.0.7"


# -- registration and bad configuration ----------------------------------------------------


def test_plugin_installed_and_registered() -> None:
    assert plugins().get_class("aws-batch") is AwsBatchBackend
    assert plugins().get_class("aws") is AwsBatchBackend
    info = {i.name: i for i in plugins().backends()}["aws-batch"]
    assert info.package == "fiber-aws" and info.aliases == ("aws",)
    assert config.lookup("queue", "aws").value == CPU_QUEUE
    assert create_backend("aws", "r").settings["queue"] == CPU_QUEUE


def test_no_queue_for_the_gpu_type_lists_the_configured_ones() -> None:
    @fiber_core.meta(gpu=1, gpu_type="h100")
    def f() -> None:
        pass

    with pytest.raises(BackendError) as e:
        fiber_core.Process(target=f, backend="aws-batch").start()
    assert "no job queue for GPU type 'h100'" in str(e.value)
    assert "a10g -> fiber-gpu-a10g, t4 -> fiber-gpu-t4" in str(e.value)
    assert "gpu_queues" in str(e.value)


@pytest.mark.parametrize(("spec", "message"), [
    (JobSpec(command=["true"], gpu=1), "without a GPU type"),
    (JobSpec(command=["true"], gpu=-1), "AWS Batch needs a count"),
])
def test_gpu_requests_batch_cannot_route(aws: AwsBatchBackend, spec: JobSpec, message: str) -> None:
    with pytest.raises(BackendError, match=message):
        aws.start_job(spec)


def test_missing_cpu_queue_and_image(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FIBER_AWS_QUEUE")
    with pytest.raises(BackendError, match=r"no job queue for CPU jobs.*FIBER_AWS_QUEUE"):
        make_backend("t").start_job(JobSpec(command=["true"]))
    monkeypatch.delenv("FIBER_AWS_IMAGE")
    with pytest.raises(BackendError, match=r"no image for aws-batch jobs.*FIBER_AWS_IMAGE"):
        make_backend("t").start_job(JobSpec(command=["true"], gpu_type="a10g"))


def test_unknown_queue_is_reported_with_what_to_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FIBER_AWS_QUEUE", "no-such-queue")
    with pytest.raises(BackendError, match=r"did not accept .* on queue 'no-such-queue'.*check that job queue"):
        make_backend("t").start_job(JobSpec(command=["true"]))


def test_missing_credentials_or_region(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FIBER_AWS_REGION")
    with pytest.raises(BackendError, match=r"no AWS region.*FIBER_AWS_REGION"):
        make_backend("t")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(BackendError, match=r"no AWS credentials found.*standard chain"):
        make_backend("t")


def test_unreachable_endpoint_reads_at_a_glance(tmp_path: Path) -> None:
    """An endpoint that does not answer: the program's frame first, then one line that says to check
    the network and endpoint (not a permission), with botocore's error summed up, not chained."""
    with socket.socket() as s:  # a port of this machine where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    env = {**os.environ, "FIBER_BACKEND": "aws-batch", "FIBER_AWS_ENDPOINT_URL": endpoint,
           "FIBER_LISTEN_HOST": "127.0.0.1", "FIBER_AWS_API_TIMEOUT": "5"}
    line, _ = failing_program(tmp_path, env, timeout=WAIT)
    assert line.startswith(f"fiber_core.base.errors.BackendError: cannot register a job definition for image "
                           f"{IMAGE} on AWS Batch in {REGION} at {endpoint}: AWS Batch in {REGION} at "
                           f"{endpoint} does not answer; check the network"), line
    assert "permission" not in line
    assert line.index("FIBER_AWS_ENDPOINT_URL") < line.index("(cause: botocore.exceptions.EndpointConnectionError: ")
    # fiber clean says the same, and keeps botocore's error.
    with pytest.raises(BackendError, match="does not answer") as e:
        AwsBatchBackend.clean(make_backend(endpoint_url=endpoint).settings, "r")
    assert type(e.value.cause).__name__ == "EndpointConnectionError"


def test_credentials_in_fiber_configuration_are_refused(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    monkeypatch.setenv("FIBER_AWS_SECRET_ACCESS_KEY", "x")
    with pytest.raises(ConfigError, match=r"refusing AWS credentials.*FIBER_AWS_SECRET_ACCESS_KEY.*boto3 chain"):
        make_backend("t")
    monkeypatch.delenv("FIBER_AWS_SECRET_ACCESS_KEY")
    (tmp_path / ".fiberconfig").write_text("[aws]\naws_access_key_id = AKIAIOSFODNN7EXAMPLE\n")
    monkeypatch.chdir(tmp_path)
    config.reset()
    # Not an [aws] option: Fiber never hands it to the backend, and refuses the file when it
    # checks it (fiber config); the backend sees only its resolved settings.
    with pytest.raises(ConfigError, match=r"unknown key 'aws_access_key_id' in \[aws\]"):
        config.check_file()
    with pytest.raises(ConfigError, match=r"unknown key 'aws_access_key_id' in \[aws\]"):
        create_backend("aws-batch", "t")  # what Fiber does when a program selects the backend
    assert "aws_access_key_id" not in make_backend("t").settings
    (tmp_path / ".fiberconfig").write_text("[aws]\njob_role = AKIAIOSFODNN7EXAMPLE\n")
    config.reset()
    with pytest.raises(ConfigError, match=r"an access key id in setting 'job_role'"):
        make_backend("t")
    (tmp_path / ".fiberconfig").write_text("[aws]\nextra_env = A=1,AWS_SECRET_ACCESS_KEY=x\n")
    config.reset()
    with pytest.raises(ConfigError, match=r"AWS_SECRET_ACCESS_KEY in \[aws\] extra_env.*job_role"):
        make_backend("t")
    (tmp_path / ".fiberconfig").unlink()
    config.reset()


def test_bad_gpu_queues_entry() -> None:
    with pytest.raises(ConfigError, match=r"bad gpu_queues entry 'a10g'.*GPU_TYPE:QUEUE"):
        AwsBatchBackend({"gpu_queues": "a10g"}, "t")


def test_extra_env_reaches_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FIBER_AWS_EXTRA_ENV", "FIBER_TEST_A=1,FIBER_TEST_B=two")
    b = make_backend()
    try:
        job = b.start_job(JobSpec(command=["python3", "-c", "import os, sys; "
                                           "sys.exit(0 if os.environ['FIBER_TEST_B'] == 'two' else 3)"]))
        assert b.wait_for_job(job, WAIT) == 0
    finally:
        b.cleanup()


def test_working_directory_and_volumes(aws: AwsBatchBackend, tmp_path: Path) -> None:
    token = secrets.token_hex(8)
    (tmp_path / "token").write_text(token)
    job = aws.start_job(JobSpec(
        command=["python3", "-c", f"import os, sys; sys.exit(0 if os.getcwd() == '/data' and "
                                  f"open('token').read() == {token!r} else 5)"],
        name="mounted", cwd="/data", volumes={str(tmp_path): "/data"}))
    assert aws.wait_for_job(job, WAIT) == 0, aws.get_job_logs(job)
    with pytest.raises(BackendError, match="mounts host paths only"):
        aws.start_job(JobSpec(command=["true"], volumes={"named-volume": "/data"}))
