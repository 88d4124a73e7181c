"""The durable ES run: examples/es.py with a journal, its master SIGKILLed at random moments and
rerun with the same command, ends with the policy of an uninterrupted run, bit for bit; the work
run twice is only what was in flight at each kill."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from procs import wait_until

from fiber_core.parallel.durable import records
from fiber_core.parallel.durable.replay import Recorded

pytest.importorskip("gymnasium")

ES = Path(__file__).parent.parent / "examples" / "es.py"
ITERATIONS = int(os.environ.get("ES_TEST_ITERATIONS", "12"))  # the size: 30 and 5
KILLS = int(os.environ.get("ES_TEST_KILLS", "3"))
POPULATION = 8
ARGS = ["--iterations", str(ITERATIONS), "--population", str(POPULATION), "--workers", "2",
        "--noise-mib", "1"]
TASKS = ITERATIONS * (POPULATION + 1)  # a map of POPULATION units and one apply per iteration


def _es(tmp_path: Path, tmpdir: str, journal: Path | None, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": tmpdir}
    if journal is not None:
        env["FIBER_JOURNAL"] = str(journal)
    return subprocess.Popen([sys.executable, str(ES), *ARGS, *extra], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _lines(path: Path) -> list[tuple[int, int]]:
    if not path.exists():
        return []
    return [(int(a), int(b)) for a, b in (line.split() for line in path.read_text().splitlines()
                                          if line.count(" ") == 1)]


def _recorded(journal: Path) -> set[tuple[int, int]]:
    """(call, item) of every unit the journal holds (the units of ES's calls are single items)."""
    scan = records.scan((journal / "journal").read_bytes())
    recorded = Recorded()
    for kind, payload in scan.records[1:]:
        recorded.add(kind, payload)
    return {(call, index) for call, units in recorded.units.items() for index in units}


@pytest.mark.timeout(300)
def test_es_killed_at_random_moments_ends_with_the_uninterrupted_policy_and_reruns_only_work_in_flight(
        tmp_path: Path, own_tmpdir: str) -> None:
    reference = _es(tmp_path, own_tmpdir, None, "--save", "reference.npy")
    assert reference.wait(timeout=120) == 0, reference.stderr.read() if reference.stderr else ""
    journal = tmp_path / "journal"
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    started: list[set[tuple[int, int]]] = []
    in_flight: list[set[tuple[int, int]]] = []
    kills = 0
    for run in range(KILLS):
        done = _recorded(journal) if journal.exists() else set()
        left = TASKS - len(done)
        if left < 4:
            break
        log = tmp_path / f"tasks-{run}"
        proc = _es(tmp_path, own_tmpdir, journal, "--task-log", str(log))
        at = rng.randrange(1, left // 2)  # tasks this run starts before its master is killed
        wait_until(lambda log=log, at=at, proc=proc: len(_lines(log)) >= at or proc.poll() is not None,
                   f"run {run} started {at} tasks")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        if proc.stderr:
            proc.stderr.close()
        kills += 1
        ran = set(_lines(log))
        started.append(ran)
        in_flight.append(ran - _recorded(journal))
    last = _es(tmp_path, own_tmpdir, journal, "--task-log", str(tmp_path / "tasks-last"), "--save", "durable.npy")
    assert last.wait(timeout=120) == 0, last.stderr.read() if last.stderr else ""
    started.append(set(_lines(tmp_path / "tasks-last")))

    assert kills == KILLS, f"kill seed {seed}"
    assert (tmp_path / "durable.npy").read_bytes() == (tmp_path / "reference.npy").read_bytes(), \
        f"kill seed {seed}"
    assert _recorded(journal) == {(c, i) for c in range(2 * ITERATIONS)
                                  for i in range(POPULATION if c % 2 == 0 else 1)}
    # Whatever ran a second time was in flight (started, not recorded) when a master was killed.
    twice = 0
    for j in range(1, len(started)):
        again = started[j] & set().union(*started[:j])
        assert again <= set().union(*in_flight[:j]), f"kill seed {seed}"
        twice += len(again)
    assert twice <= sum(map(len, in_flight))
    print(f"kill seed {seed}: {TASKS} tasks, {sum(map(len, started))} run, {twice} run twice; "
          f"in flight at the kills: {[len(f) for f in in_flight]}")
