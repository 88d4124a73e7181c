"""Durable runs on the local backend: a rerun replays what its journal recorded, and runs the rest.

Each test runs tests/journal_program.py (or a variant) as a real program, twice or more,
on one journal directory, and reads what its tasks ran from the file they append to.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from fiber_core.parallel.durable import records
from fiber_core.parallel.durable.task import seed_of

T = 60.0
PROGRAM = Path(__file__).with_name("journal_program.py")


class Runs:
    """Runs of the journal program in ``tmp_path``, with one journal."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path
        self.journal = tmp_path / "journal"
        self.program = tmp_path / "program.py"
        shutil.copy(PROGRAM, self.program)
        self.ran_file = tmp_path / "ran"

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "FIBER_JOURNAL": str(self.journal), "RAN": str(self.ran_file), **extra}

    def run(self, program: Path | None = None, **extra: str) -> subprocess.CompletedProcess:
        self.ran_file.unlink(missing_ok=True)
        return subprocess.run([sys.executable, str(program or self.program)], capture_output=True,
                              text=True, env=self.env(**extra), cwd=self.dir, timeout=T)

    def ran(self) -> Counter[tuple[int, int]]:
        """(call, item) of each task that ran in the last run, and how many times."""
        if not self.ran_file.exists():
            return Counter()
        return Counter(tuple(map(int, line.split())) for line in self.ran_file.read_text().split("\n") if line)  # type: ignore[misc]

    def file(self) -> Path:
        return self.journal / "journal"

    def seed(self) -> int:
        scan = records.scan(self.file().read_bytes())
        return records.read_header(scan.records[0][1])["seed"]


@pytest.fixture
def runs(tmp_path: Path) -> Runs:
    return Runs(tmp_path)


def _results(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_rerun_takes_every_recorded_result_and_runs_no_task(runs: Runs) -> None:
    first = _results(runs.run())
    assert sum(runs.ran().values()) == 8 + 2 + 1 + 3 + 2 + 1 + 2
    again = _results(runs.run())
    assert again == first
    assert runs.ran() == Counter()


def test_a_run_that_stopped_half_way_runs_only_what_did_not_finish_with_the_same_seeds(runs: Runs) -> None:
    failed = runs.run(FAIL_FROM="4")
    assert failed.returncode == 3, failed.stderr
    assert {item for call, item in runs.ran() if call == 0} >= {0, 1, 2, 3, 4}
    out = _results(runs.run())
    assert {item for call, item in runs.ran() if call == 0} == {4, 5, 6, 7}
    seed = runs.seed()
    assert out["map"] == [[i * i, 0, i, seed_of(seed, 0, i)] for i in range(8)]


def test_a_call_that_differs_ends_the_replay_with_one_warning_and_nothing_recorded_is_misused(runs: Runs) -> None:
    _results(runs.run())
    proc = runs.run(SHIFT="1")
    out = _results(proc)
    assert out["map"][0][0] == 1 and out["map"][7][0] == 64  # (i + 1) ** 2: computed, not replayed
    warnings = [line for line in proc.stderr.splitlines() if "replay ends" in line]
    assert warnings == ["fiber: the journal's replay ends at call 0, map(square): its arguments "
                        "differ from the recorded ones; it and the calls after it run again"]
    assert sum(runs.ran().values()) == 19  # everything ran again
    # The journal now holds the changed program's calls: a third run replays them all.
    assert _results(runs.run(SHIFT="1")) == out
    assert runs.ran() == Counter()


def test_the_task_seed_is_the_runs_seed_setting_and_the_same_on_a_retry(run_script) -> None:  # noqa: ANN001
    proc = run_script("""
        import json
        import fiber_core as mp

        seen = []

        def flaky(x):
            task = mp.current_task()
            if task.attempt == 0:
                raise ValueError(task.seed)
            return task

        if __name__ == "__main__":
            mp.init(seed=5)
            with mp.Pool(1) as pool:
                pool.map(int, [1])
                retried = pool.apply(flaky, (1,), retries=1)
                print(json.dumps([mp.current_task(), list(retried)]))
    """)
    assert proc.returncode == 0, proc.stderr
    outside, retried = json.loads(proc.stdout)
    assert outside is None
    assert retried == [1, 0, 1, seed_of(5, 1, 0)]
