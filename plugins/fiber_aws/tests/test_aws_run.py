"""``fiber run --backend aws-batch [--durable]`` against moto, with AWS Batch's retries emulated.

moto 5 keeps a job's ``retryStrategy`` and never retries, and it has no instance to lose. The
tests run against ``batch_emulator.py`` (moto's server with retries as AWS Batch documents
them, and ``POST /fiber-emulator/lose-host``, which ends a running attempt as a lost EC2
instance does: container killed, statusReason ``Host EC2 (instance i-...) terminated.``). The
shared moto service runs it once ``scripts/services/moto.sh`` is restarted; until the service
runs this very file, the module starts an emulator of its own on another 127.0.0.1 port.

The program's job runs the ``fiber-test`` image with fiber-aws, boto3 and this tree's
fiber_core mounted from a directory of this machine (``build_job_site``); its processes' jobs
run the image alone. Its journal is in moto's S3.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import docker
import pytest
from aws_helpers import CPU_QUEUE, IMAGE, REGION, SERVICES, WAIT, ensure_infrastructure, read_env
from batch_emulator import CONTAINER_EXITED, matches, retried, revision
from fiber_core.testing.job_site import build_job_site

from fiber_aws.durable import HOST_LOST, MAX_ATTEMPTS, attempt_ended, retry_strategy

HERE = Path(__file__).parent
BUCKET = "fiber-durable-runs"
JOB_ROLE = "arn:aws:iam::123456789012:role/fiber-program"
EXECUTION_ROLE = "arn:aws:iam::123456789012:role/fiber-execution"
N = 200
"""Items of the durable program's map (30 ms each, on two workers)."""
LOST_AFTER = 100
"""Items the first attempt has run when its host is lost."""
IN_FLIGHT = 70
"""Items at most that a loss makes run twice: each of the two workers' batch (MAP_BATCH_SECONDS,
about 8 items) and the one prefetched after it, and the results of the last half second
(a journal segment in object storage is written every 0.5 s: about 33 items)."""

DURABLE_PROGRAM = f"""
import os, time
import fiber_core as multiprocessing


def slow_square(x):
    time.sleep(0.03)
    print("ran", x, flush=True)
    return x * x


if __name__ == "__main__":
    print("start", os.environ.get("AWS_BATCH_JOB_ATTEMPT"), flush=True)
    with multiprocessing.Pool(2) as pool:
        total = sum(pool.map(slow_square, range({N}), chunksize=1))
    print("result", total, flush=True)
"""


PROGRAM = """
import sys
import fiber_core as multiprocessing
from fiber_core.runtime.run import runtime


def square(x):
    return x * x


if __name__ == "__main__":
    with multiprocessing.Pool(2) as pool:
        print("squares", sum(pool.map(square, range(8))), runtime().run_id, flush=True)
    sys.exit(3)
"""


def _opener() -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _revision(endpoint: str) -> str | None:
    try:
        with _opener().open(endpoint + "/fiber-emulator/revision", timeout=5) as r:
            return json.load(r).get("revision")
    except (OSError, ValueError):
        return None


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The endpoint of an emulator that runs this ``batch_emulator.py``: the shared one, or one of ours."""
    shared = read_env(SERVICES / "moto" / "env")
    if "DOCKER_HOST" not in shared:
        pytest.fail(f"moto is not running ({SERVICES}/moto/env is missing): bash scripts/test-services.sh up docker moto")
    if _revision(shared["FIBER_MOTO_ENDPOINT"]) == revision():
        yield shared["FIBER_MOTO_ENDPOINT"]
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = "http://127.0.0.1:9"  # nothing leaves 127.0.0.0/8, as in moto.sh
    env = {**os.environ, "DOCKER_HOST": shared["DOCKER_HOST"], "MOTO_DOCKER_NETWORK_MODE": "host",
           "MOTO_PORT": str(port), "AWS_EC2_METADATA_DISABLED": "true", "HTTP_PROXY": dead, "HTTPS_PROXY": dead,
           "http_proxy": dead, "https_proxy": dead, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    log = tmp_path_factory.mktemp("emulator") / "log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(HERE / "batch_emulator.py"), "-H", "127.0.0.1", "-p", str(port)],
                                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + WAIT
        while _revision(endpoint) != revision():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)  # its port opens when it has loaded moto: nothing to wait on but a request
        yield endpoint
    finally:
        _opener().open(urllib.request.Request(endpoint + "/moto-api/reset", method="POST"), timeout=30).read()
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def aws(emulator: str) -> Iterator[str]:
    """This module's environment, pointed at the emulator: fake credentials, [aws] settings, a bucket."""
    mp = pytest.MonkeyPatch()
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION", "FIBER_LISTEN_HOST", "FIBER_BACKEND", "FIBER_JOURNAL"):
        mp.delenv(var, raising=False)
    no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1,localhost"]))
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": REGION,
        "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": "/nonexistent/aws-config",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials", "NO_PROXY": no_proxy, "no_proxy": no_proxy,
        "FIBER_AWS_ENDPOINT_URL": emulator, "FIBER_AWS_REGION": REGION, "FIBER_AWS_QUEUE": CPU_QUEUE,
        "FIBER_AWS_IMAGE": IMAGE, "FIBER_AWS_POLL_INTERVAL": "0.2", "FIBER_AWS_JOB_ROLE": JOB_ROLE,
        # the processes' jobs get the run's key from SSM, which the emulator injects as ECS does
        "FIBER_AWS_KEY_FROM": "ssm", "FIBER_AWS_EXECUTION_ROLE": EXECUTION_ROLE,
    }.items():
        mp.setenv(key, value)
    ensure_infrastructure(emulator)
    s3 = boto3.client("s3", region_name=REGION, endpoint_url=emulator)
    if BUCKET not in [b["Name"] for b in s3.list_buckets().get("Buckets", [])]:
        s3.create_bucket(Bucket=BUCKET)
    yield emulator
    mp.undo()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if sys.version_info[:2] != (3, 11):
        pytest.skip("the program's job runs Python 3.11 (the test image): boto3 is copied from this environment")
    return build_job_site(tmp_path_factory.mktemp("job-site") / "site", HERE.parent / "fiber_aws", "fiber-aws", "boto3")


def fiber(*args: str, timeout: float = 3 * WAIT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fiber_core.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


def job_args(site: Path, endpoint: str, *more: str) -> list[str]:
    """What the program's job needs in this setup: fiber-aws and boto3, and moto's S3."""
    return ["--volume", f"{site}:{site}", "--env", f"PYTHONPATH={site}", "--env", "PYTHONUNBUFFERED=1",
            "--env", f"AWS_ENDPOINT_URL={endpoint}", "--env", f"AWS_DEFAULT_REGION={REGION}", *more]


def lose_host(endpoint: str, job_id: str) -> str:
    request = urllib.request.Request(endpoint + "/fiber-emulator/lose-host", data=json.dumps({"jobId": job_id}).encode(),
                                     method="POST")
    with _opener().open(request, timeout=30) as r:
        return json.load(r)["statusReason"]


def container_output(job: dict) -> str:
    """What the job's running container printed so far (moto copies it to CloudWatch Logs at its end)."""
    client = docker.DockerClient(base_url=read_env(SERVICES / "moto" / "env")["DOCKER_HOST"], timeout=60)
    try:
        return client.containers.get(f"{job['jobName']}-{job['jobId']}").logs().decode(errors="replace")
    except docker.errors.NotFound:
        return ""
    finally:
        client.close()


# -- the emulator's retries, and the strategy fiber run gives ------------------------------------


def test_the_emulator_retries_as_aws_batch_documents_it() -> None:
    strategy = retry_strategy(0)
    host = "Host EC2 (instance i-0123456789abcdef0) terminated."
    assert matches("Host EC2*", host) and not matches("Host EC2", host) and matches(None, "")
    assert retried(strategy, 1, host, "", None)
    assert retried(strategy, MAX_ATTEMPTS - 1, host, "", None)
    assert not retried(strategy, MAX_ATTEMPTS, host, "", None)  # every attempt counts
    assert not retried(strategy, 1, CONTAINER_EXITED, "", 3)  # the program's own failure
    assert retried({"attempts": 2, "evaluateOnExit": [{"onExitCode": "3", "action": "EXIT"}]}, 1, "", "", 4)
    assert not retried({"attempts": 1}, 1, host, "", None) and not retried(None, 1, host, "", None)


def test_retries_let_the_program_fail_and_count_with_lost_hosts() -> None:
    assert retry_strategy(0) == {"attempts": 10, "evaluateOnExit": [HOST_LOST, {"onReason": "*", "action": "EXIT"}]}
    assert retry_strategy(2) == {"attempts": 3, "evaluateOnExit": [HOST_LOST, {"onReason": "*", "action": "RETRY"}]}
    with pytest.raises(ValueError, match="at most 10 attempts, so --retries 9 at most"):
        retry_strategy(10)
    said = attempt_ended({"statusReason": "Host EC2 (instance i-1) terminated."}, 1, 10)
    assert said == "attempt 1 of 10 ended (Host EC2 (instance i-1) terminated.); AWS Batch starts the program again"


# -- fiber run on AWS Batch -------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_fiber_run_runs_the_program_as_a_batch_job_whose_processes_are_batch_jobs(aws: str, site: Path) -> None:
    batch = boto3.client("batch", region_name=REGION, endpoint_url=aws)
    out = fiber("run", "--backend", "aws-batch", *job_args(site, aws), "python3", "-c", PROGRAM)
    assert out.returncode == 3, out.stdout + out.stderr  # the program's exit status
    (line,) = [line.split() for line in out.stdout.splitlines() if line.startswith("squares")]
    assert line[1] == str(sum(x * x for x in range(8)))
    run = line[2]
    assert re.match(rf"fiber run: AWS Batch job \S+ \(image {IMAGE}, run {run}\)$", out.stderr.splitlines()[0])
    names = [j["jobName"] for j in batch.list_jobs(
        jobQueue=CPU_QUEUE, filters=[{"name": "JOB_NAME", "values": [f"fiber-{run}-*"]}])["jobSummaryList"]]
    assert f"fiber-{run}-1-fiber-run" in names  # the program's job, and its pool's workers beside it
    workers = [j for j in batch.list_jobs(jobQueue=CPU_QUEUE, filters=[
        {"name": "JOB_NAME", "values": [f"fiber-{run}-*"]}])["jobSummaryList"] if "PoolWorker" in j["jobName"]]
    assert workers, names
    # the workers had the program's run key from SSM (its parameter is gone with the run)
    job = batch.describe_jobs(jobs=[workers[0]["jobId"]])["jobs"][0]
    jobdef = batch.describe_job_definitions(jobDefinitions=[job["jobDefinition"]])["jobDefinitions"][0]
    assert [s["name"] for s in jobdef["containerProperties"]["secrets"]] == ["FIBER_AUTHKEY"]
    assert "FIBER_AUTHKEY" not in {e["name"] for e in job["container"]["environment"]}


def test_a_detached_run_prints_its_job_and_leaves_it_running(aws: str) -> None:
    batch = boto3.client("batch", region_name=REGION, endpoint_url=aws)
    out = fiber("run", "--backend", "aws-batch", "--detach", "python3", "-c", "print('detached')", timeout=WAIT)
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip()
    deadline = time.monotonic() + WAIT
    while (job := batch.describe_jobs(jobs=[job_id])["jobs"][0])["status"] not in ("SUCCEEDED", "FAILED"):
        assert time.monotonic() < deadline, job
        time.sleep(0.2)  # Batch has no watch
    assert job["status"] == "SUCCEEDED" and "retryStrategy" not in job


@pytest.mark.timeout(600)
def test_a_durable_run_whose_host_is_lost_is_retried_and_runs_only_what_was_not_finished(
        aws: str, site: Path) -> None:
    """The program's job loses its host mid-run (the emulator's lose-host, as an EC2 instance
    terminated or reclaimed): AWS Batch's retry strategy starts it again, and with its journal in
    S3 the second attempt runs only the tasks the first had not finished; `fiber run` shows
    both attempts' output and exits 0 with the result of an undisturbed run."""
    batch = boto3.client("batch", region_name=REGION, endpoint_url=aws)
    journal = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}"
    prog = subprocess.Popen([sys.executable, "-m", "fiber_core.cli", "run", "--backend", "aws-batch", "--durable",
                             *job_args(site, aws, "--env", f"FIBER_JOURNAL={journal}", "--env",
                                       "FIBER_PROGRAM=durable-batch-test"),
                             "python3", "-c", DURABLE_PROGRAM], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert prog.stderr is not None
        said = prog.stderr.readline()
        m = re.match(r"fiber run: AWS Batch job (\S+) \(image .*, durable\)$", said.strip())
        assert m, said + prog.stderr.read()
        job_id = m.group(1)
        deadline = time.monotonic() + 2 * WAIT
        while True:  # the first attempt has run LOST_AFTER tasks
            job = batch.describe_jobs(jobs=[job_id])["jobs"][0]
            if len(re.findall(r"\bran \d+", container_output(job))) >= LOST_AFTER:
                break
            assert job["status"] not in ("SUCCEEDED", "FAILED"), job
            assert time.monotonic() < deadline, f"the program's job did not get through {LOST_AFTER} tasks"
            time.sleep(0.2)  # the container's output has no event to wait on
        reason = lose_host(aws, job_id)
        out, err = prog.communicate(timeout=4 * WAIT)
    finally:
        if prog.poll() is None:
            prog.kill()
            prog.communicate()
    assert prog.returncode == 0, out + err
    lines = out.splitlines()
    assert [line.split() for line in lines if line.startswith("result")] == [["result", str(sum(x * x for x in range(N)))]]
    assert [line for line in lines if line.startswith("start")] == ["start 1", "start 2"]
    runs, attempt = [0, 0], -1
    for line in lines:
        attempt += line.startswith("start")
        runs[attempt] += bool(re.search(r"\bran \d+", line))
    # the second attempt went on from the journal: at most what was in flight at the loss ran twice
    assert runs[0] >= LOST_AFTER and 0 < runs[1] <= N - LOST_AFTER + IN_FLIGHT and sum(runs) <= N + IN_FLIGHT, runs
    assert f"attempt 1 of 10 ended ({reason}); AWS Batch starts the program again" in err
    job = batch.describe_jobs(jobs=[job_id])["jobs"][0]
    assert job["status"] == "SUCCEEDED" and len(job["attempts"]) == 2
    assert job["attempts"][0]["statusReason"] == reason and reason.startswith("Host EC2 (instance i-")
    assert job["retryStrategy"] == retry_strategy(0)
    # no key and no credentials in the job: the program makes its run's key when it starts
    jobdef = batch.describe_job_definitions(jobDefinitions=[job["jobDefinition"]])["jobDefinitions"][0]
    described = json.dumps([job, jobdef], default=str)
    assert "FIBER_AUTHKEY" not in described and "AWS_SECRET_ACCESS_KEY" not in described
    assert "AWS_ACCESS_KEY_ID" not in described and "testing" not in described
    env = {e["name"]: e["value"] for e in job["container"]["environment"]}
    assert env["FIBER_BACKEND"] == "aws-batch" and env["FIBER_JOURNAL_WAIT"] == "60.0"
    assert "FIBER_RUN_ID" not in env  # every attempt is a run of its own
    assert jobdef["containerProperties"]["jobRoleArn"] == JOB_ROLE


@pytest.mark.timeout(300)
def test_a_durable_programs_own_failure_ends_its_job_at_the_first_attempt(aws: str, site: Path) -> None:
    batch = boto3.client("batch", region_name=REGION, endpoint_url=aws)
    out = fiber("run", "--backend", "aws-batch", "--durable", *job_args(site, aws),
                "python3", "-c", "import sys; print('failing', flush=True); sys.exit(3)")
    assert out.returncode == 3, out.stderr
    assert out.stdout == "failing\n"
    assert "--durable without a journal: each start runs the program from its beginning" in out.stderr
    job_id = re.search(r"AWS Batch job (\S+)", out.stderr).group(1)  # type: ignore[union-attr]
    job = batch.describe_jobs(jobs=[job_id])["jobs"][0]
    assert job["status"] == "FAILED" and len(job["attempts"]) == 1


@pytest.mark.parametrize(("args", "message"), [
    (["--backend", "nope"], "fiber: error: unknown backend 'nope' (installed: "),
    (["--backend", "local"], "fiber: error: fiber run launches programs on aws-batch or kubernetes, not on 'local'"),
    (["--backend", "aws-batch", "--durable", "--retries", "10"],
     "fiber: error: --retries 10 is more than AWS Batch allows: a job has at most 10 attempts, so --retries 9 at most"),
    (["--backend", "aws-batch", "--retries", "2"], "fiber: error: --retries is for --durable runs: add --durable"),
    (["--backend", "aws-batch", "--env", "AWS_SECRET_ACCESS_KEY=abc"],
     "fiber: error: --env AWS_SECRET_ACCESS_KEY: AWS credentials never go into a job"),
    (["--backend", "aws-batch", "--volume", "data:/data"], "fiber: error: --volume 'data:/data': expected /HOST/PATH:/PATH"),
], ids=["unknown-backend", "no-launcher", "too-many-retries", "retries-without-durable", "credentials", "volume"])
def test_bad_input_to_fiber_run_is_one_clear_line_and_submits_nothing(aws: str, args: list[str], message: str) -> None:
    batch = boto3.client("batch", region_name=REGION, endpoint_url=aws)
    before = len(batch.list_jobs(jobQueue=CPU_QUEUE, jobStatus="SUBMITTED")["jobSummaryList"])
    out = fiber("run", *args, "python3", "-c", "pass", timeout=WAIT)
    assert out.returncode == 2 and out.stderr.startswith(message), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and out.stdout == ""
    assert len(batch.list_jobs(jobQueue=CPU_QUEUE, jobStatus="SUBMITTED")["jobSummaryList"]) == before


def test_a_backend_option_after_others_picks_the_launcher_whose_options_they_are(aws: str) -> None:
    out = fiber("run", "--queue", "no-such-queue", "--backend", "aws-batch", "--detach", "python3", "-c", "pass",
                timeout=WAIT)
    assert out.returncode == 2
    assert out.stderr.startswith("fiber: error: AWS Batch did not accept fiber-run on queue 'no-such-queue'"), out.stderr
