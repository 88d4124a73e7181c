"""A durable run's journal in S3 (moto's): what a rerun replays, one master at a time, a damaged
segment; the core's tests/journal_program.py run as a real program with ``journal = s3://...``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from fiber_aws.journal import S3Store, parse_url

SERVICES = Path(os.environ.get("FIBER_SERVICES_DIR", "/tmp/fiber-services"))
PROGRAM = Path(__file__).parents[3] / "tests" / "journal_program.py"
BUCKET = "fiber-journal-tests"
T = 60.0


@pytest.fixture(scope="module")
def endpoint() -> str:
    env = dict(line.split("=", 1) for line in (SERVICES / "moto" / "env").read_text().splitlines()
               if "=" in line) if (SERVICES / "moto" / "env").exists() else {}
    if "FIBER_MOTO_ENDPOINT" not in env:
        pytest.fail(f"moto is not running ({SERVICES}/moto/env is missing): "
                    "bash scripts/test-services.sh up moto")
    return env["FIBER_MOTO_ENDPOINT"]


@pytest.fixture
def aws_env(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "NO_PROXY": "127.0.0.1,localhost"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "FIBER_BACKEND", "FIBER_JOURNAL"):
        monkeypatch.delenv(key, raising=False)
    import boto3

    s3 = boto3.client("s3")
    if BUCKET not in [b["Name"] for b in s3.list_buckets().get("Buckets", [])]:
        s3.create_bucket(Bucket=BUCKET)
    return env


class Runs:
    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path
        self.url = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}"
        self.program = tmp_path / "program.py"
        shutil.copy(PROGRAM, self.program)
        self.ran_file = tmp_path / "ran"

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "FIBER_JOURNAL": self.url, "RAN": str(self.ran_file), **extra}

    def run(self, **extra: str) -> subprocess.CompletedProcess:
        self.ran_file.unlink(missing_ok=True)
        return subprocess.run([sys.executable, str(self.program)], capture_output=True, text=True,
                              env=self.env(**extra), cwd=self.dir, timeout=T)

    def ran(self) -> int:
        return len(self.ran_file.read_text().splitlines()) if self.ran_file.exists() else 0


def _results(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def runs(tmp_path: Path, aws_env: dict[str, str]) -> Runs:
    return Runs(tmp_path)


def test_a_journal_url_names_a_bucket_and_a_prefix() -> None:
    assert parse_url("s3://b/runs/es-1/") == ("b", "runs/es-1")
    assert parse_url("s3://b") == ("b", "")
    with pytest.raises(ValueError, match="expected s3://bucket"):
        parse_url("s3:///x")


def test_a_rerun_on_a_journal_in_s3_takes_every_recorded_result_and_runs_no_task(runs: Runs) -> None:
    first = _results(runs.run())
    assert runs.ran() == 19
    assert _results(runs.run()) == first
    assert runs.ran() == 0
    store = S3Store(runs.url)
    names = store.names()
    assert "lease" not in names  # let go at exit
    assert [n for n in names if n.startswith("journal/")] != []


def test_a_run_stopped_half_way_runs_only_what_did_not_finish(runs: Runs) -> None:
    assert runs.run(FAIL_FROM="4").returncode == 3
    out = _results(runs.run())
    assert [row[0] for row in out["map"]] == [i * i for i in range(8)]
    assert runs.ran() == 4 + 11  # items 4-7 of the first map, then every later call


def test_a_second_master_on_an_s3_journal_refuses_naming_the_first(runs: Runs) -> None:
    first = subprocess.Popen([sys.executable, str(runs.program)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=runs.env(HOLD="1"), cwd=runs.dir)
    try:
        assert first.stdout is not None and first.stdout.readline() == "holding\n"
        second = runs.run()
        assert second.returncode == 1
        assert second.stderr.strip().splitlines()[-1].startswith(
            f"fiber_core.base.errors.JournalBusyError: the journal at {runs.url} is in use by another "
            f"master of this program, pid {first.pid} on host ")
    finally:
        out, err = first.communicate("\n", timeout=T)
    assert first.returncode == 0, err


def test_a_damaged_segment_is_reported_and_what_it_held_runs_again_with_the_right_results(runs: Runs) -> None:
    expected = _results(runs.run())
    store = S3Store(runs.url)
    segments = sorted(n for n in store.names("journal/") if not n.endswith(".base"))
    assert segments, store.names()
    got = store.get(segments[-1])
    assert got is not None
    data = bytearray(got[0])
    data[-1] ^= 0x01  # in the last record
    store.put(segments[-1], bytes(data))
    proc = runs.run()
    assert _results(proc) == expected
    lines = [line for line in proc.stderr.splitlines() if "damaged" in line]
    assert len(lines) == 1 and lines[0].startswith(f"fiber: the journal at {runs.url}: record ")
    assert lines[0].endswith("and their work runs again")
    assert 0 < runs.ran() < 19


def test_a_killed_masters_s3_lease_is_taken_at_once_and_the_rerun_gives_the_undisturbed_results(
        runs: Runs, tmp_path: Path) -> None:
    expected = _results(subprocess.run([sys.executable, str(runs.program)], capture_output=True, text=True,
                                       env={**runs.env(FIBER_SEED="3"), "FIBER_JOURNAL": ""},
                                       cwd=runs.dir, timeout=T))
    own = tmp_path / "tmp"  # what the killed master leaves (its run directory) stays here
    own.mkdir()
    first = subprocess.Popen([sys.executable, str(runs.program)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=runs.env(HOLD="1", FIBER_SEED="3", TMPDIR=str(own)), cwd=runs.dir)
    assert first.stdout is not None and first.stdout.readline() == "holding\n"
    first.kill()
    first.communicate(timeout=T)
    assert "lease" in S3Store(runs.url).names()  # it had no time to let it go
    again = runs.run(FIBER_SEED="3", TMPDIR=str(own))
    assert _results(again) == expected
