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
from declared import declared_fields

from fiber_core.parallel.durable import records
from fiber_core.parallel.durable import task as task_mod
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



def test_the_task_record_type_checkers_see_is_the_one_tasks_get() -> None:
    # task.py declares Task twice: a typing.NamedTuple for type checkers, and at run time a
    # collections.namedtuple (a pool worker then starts without typing). Both must agree.
    assert declared_fields(task_mod, "Task") == task_mod.Task._fields == ("call", "item", "attempt", "seed")
    t = task_mod.Task(1, 2, 0, 99)
    call, item, attempt, seed = t  # a tuple, as the stdlib's records are
    assert (t.call, t.item, t.attempt, t.seed) == (call, item, attempt, seed) == (1, 2, 0, 99)
    assert type(t).__module__ == "fiber_core.parallel.durable.task" and "named tuple" in (type(t).__doc__ or "")

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
    assert out["map"] == [[i * i, 0, i, seed_of(seed, 0, i), ""] for i in range(8)]


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


# -- one master at a time ------------------------------------------------------------------


def _holding(runs: Runs, tmpdir: str, **extra: str) -> subprocess.Popen:
    """A master that made its first call (it holds the journal's lease) and waits for a line."""
    proc = subprocess.Popen([sys.executable, str(runs.program)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=runs.env(HOLD="1", TMPDIR=tmpdir, **extra), cwd=runs.dir)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "holding\n"
    return proc


def _release(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate("\n", timeout=T)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_a_second_master_on_the_journal_refuses_with_a_message_naming_the_first(runs: Runs, own_tmpdir: str) -> None:
    first = _holding(runs, own_tmpdir)
    try:
        second = runs.run()
        assert second.returncode == 1
        last = second.stderr.strip().splitlines()[-1]
        assert last.startswith(f"fiber_core.base.errors.JournalBusyError: the journal at {runs.journal} is "
                               f"in use by another master of this program, pid {first.pid} on host ")
        assert last.endswith("let it finish or stop it, or set journal_wait (seconds) to wait for it")
        assert runs.ran() == Counter()  # it ran nothing
    finally:
        _release(first)


def test_a_master_that_may_wait_goes_on_once_the_first_has_finished(runs: Runs, own_tmpdir: str) -> None:
    first = _holding(runs, own_tmpdir)
    second = subprocess.Popen([sys.executable, str(runs.program)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=runs.dir,
                              env=runs.env(FIBER_JOURNAL_WAIT="60", RAN=str(runs.dir / "ran2")))
    expected = _release(first)
    out, err = second.communicate(timeout=T)
    assert second.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == expected
    assert not (runs.dir / "ran2").exists()  # it replayed everything the first one did


def test_the_lease_of_a_killed_master_is_taken_at_once_and_its_finished_work_is_not_run_again(
        runs: Runs, own_tmpdir: str) -> None:
    first = _holding(runs, own_tmpdir)
    first.kill()
    first.communicate(timeout=T)
    out = _results(runs.run(TMPDIR=own_tmpdir))
    ran = runs.ran()
    assert not [task for task in ran if task[0] == 0]  # the first map finished before the kill
    assert len(out["map"]) == 8 and sum(ran.values()) == 19 - 8


# -- bad journals --------------------------------------------------------------------------


def test_a_torn_last_record_is_reported_cut_off_and_its_units_run_again(runs: Runs) -> None:
    expected = _results(runs.run())
    data = runs.file().read_bytes()
    scan = records.scan(data)
    last_kind, last = scan.records[-1]
    assert last_kind == records.UNITS
    ordinal = records.read_units(last)[0]
    runs.file().write_bytes(data[:-3])  # killed while writing its last record
    proc = runs.run()
    assert _results(proc) == expected
    problem = records.scan(data[:-3]).problem
    assert f"fiber: the journal at {runs.journal}: {problem}; it and the " in proc.stderr
    assert "bytes after it are dropped, and their work runs again" in proc.stderr
    assert {call for call, _ in runs.ran()} == {ordinal}


def test_a_flipped_bit_is_reported_and_what_follows_it_runs_again_with_the_right_results(runs: Runs) -> None:
    expected = _results(runs.run())
    data = bytearray(runs.file().read_bytes())
    scan = records.scan(bytes(data))
    # A bit of the record of the second call (the first map's units come before it).
    n = next(i for i, (kind, payload) in enumerate(scan.records)
             if kind == records.CALL and records.read_call(payload).ordinal == 1)
    at = len(records.MAGIC) + sum(8 + len(payload) + 1 for _, payload in scan.records[:n])
    data[at + 20] ^= 0x04
    runs.file().write_bytes(bytes(data))
    proc = runs.run()
    assert _results(proc) == expected
    lines = [line for line in proc.stderr.splitlines() if "damaged" in line]
    assert lines == [f"fiber: the journal at {runs.journal}: record {n + 1} at byte {at} is damaged (its "
                     f"checksum differs); it and the {len(data) - at} bytes after it are dropped, and "
                     "their work runs again"]
    ran = runs.ran()
    assert not [task for task in ran if task[0] == 0] and sum(ran.values()) == 19 - 8


def test_a_journal_of_another_program_is_set_aside_and_everything_runs(runs: Runs) -> None:
    expected = _results(runs.run(FIBER_SEED="9"))
    other = runs.dir / "other.py"
    shutil.copy(runs.program, other)
    proc = runs.run(program=other, FIBER_SEED="9")
    assert _results(proc) == expected
    aside = [p.name for p in runs.journal.iterdir() if p.name.startswith("journal.set-aside-")]
    assert len(aside) == 1
    lines = [line for line in proc.stderr.splitlines() if "set aside" in line]
    assert lines == [f"fiber: the journal at {runs.journal} belongs to another program, "
                     f"{os.path.realpath(runs.program)}, not {os.path.realpath(other)}: set aside as "
                     f"{aside[0]}; this run starts a new one and runs everything"]
    assert sum(runs.ran().values()) == 19


def _limit_file_size() -> None:
    import resource
    resource.setrlimit(resource.RLIMIT_FSIZE, (3000, 3000))


def test_a_journal_that_cannot_grow_stops_with_one_warning_and_a_rerun_runs_what_it_lost(runs: Runs) -> None:
    # Files of at most 3,000 bytes: the journal fills up during the first map (a full disk
    # for this program; Python ignores SIGXFSZ, so writes fail with EFBIG).
    proc = subprocess.run([sys.executable, str(runs.program)], capture_output=True, text=True,
                          env=runs.env(PAD="300"), cwd=runs.dir, timeout=T,
                          preexec_fn=_limit_file_size)
    expected = _results(proc)
    lines = [line for line in proc.stderr.splitlines() if "cannot be written" in line]
    assert lines == [f"fiber: the journal at {runs.journal} cannot be written (File too large): the run "
                     "goes on without it; what it did not record runs again after a restart"]
    assert runs.file().stat().st_size <= 3000
    again = runs.run(PAD="300")
    assert _results(again) == expected
    ran = runs.ran()
    assert 0 < sum(ran.values()) < 19  # what was recorded before the disk filled is not run


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="mounts a tmpfs in a mount namespace of its own: root only")
def test_a_journal_on_a_full_disk_stops_with_one_warning_and_a_rerun_runs_what_it_lost(runs: Runs) -> None:
    # A tmpfs of two pages (the lease, the journal) that the first run fills, made larger (the
    # disk cleaned up) for the second.
    runs.journal.mkdir(mode=0o700)
    script = ('mount -t tmpfs -o size=8k,mode=0700 tmpfs "$FIBER_JOURNAL" || exit 99\n'
              'RAN="$DIR/ran1" "$PY" program.py > out1 2> err1; echo $? > rc1\n'
              'mount -o remount,size=1m "$FIBER_JOURNAL"\n'
              '"$PY" program.py > out2 2> err2; echo $? > rc2\n')
    subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], check=True,
                   env=runs.env(PAD="300", PY=sys.executable, DIR=str(runs.dir)), cwd=runs.dir, timeout=2 * T)
    rc1, rc2 = ((runs.dir / f"rc{i}").read_text().strip() for i in (1, 2))
    assert (rc1, rc2) == ("0", "0"), (runs.dir / "err1").read_text() + (runs.dir / "err2").read_text()
    lines = [line for line in (runs.dir / "err1").read_text().splitlines() if "cannot be written" in line]
    assert lines == [f"fiber: the journal at {runs.journal} cannot be written (No space left on device): "
                     "the run goes on without it; what it did not record runs again after a restart"]
    first, second = ((runs.dir / f"out{i}").read_text().strip().splitlines()[-1] for i in (1, 2))
    assert json.loads(second) == json.loads(first)
    ran = runs.ran()
    assert 0 < sum(ran.values()) < 19


IMAP = """
import json, os, sys
import fiber_core as mp

def triple(x):
    with open("ran", "a") as f:
        f.write(f"{x}\\n")
    return 3 * x

if __name__ == "__main__":
    items = json.loads(sys.argv[1])
    with mp.Pool(1) as pool:
        print(json.dumps(list(pool.imap(triple, items))))
"""


def test_an_imap_whose_input_changes_half_way_takes_the_units_before_and_runs_the_rest(tmp_path: Path) -> None:
    (tmp_path / "imap.py").write_text(IMAP)
    env = {**os.environ, "FIBER_JOURNAL": str(tmp_path / "journal")}

    def run(items: list[int]) -> tuple[list[int], list[int], str]:
        (tmp_path / "ran").unlink(missing_ok=True)
        proc = subprocess.run([sys.executable, "imap.py", json.dumps(items)], capture_output=True,
                              text=True, env=env, cwd=tmp_path, timeout=T)
        assert proc.returncode == 0, proc.stderr
        ran = (tmp_path / "ran").read_text().split() if (tmp_path / "ran").exists() else []
        return json.loads(proc.stdout), sorted(map(int, ran)), proc.stderr

    assert run([1, 2, 3, 4])[:2] == ([3, 6, 9, 12], [1, 2, 3, 4])
    out, ran, err = run([1, 2, 30, 4])
    assert out == [3, 6, 90, 12]
    assert ran == [4, 30]  # units 0 and 1 were taken from the journal
    assert [line for line in err.splitlines() if "replay ends" in line] == [
        "fiber: the journal's replay ends at call 0, imap(triple), unit 2: its arguments differ from "
        "the recorded ones; it and the calls after it run again"]
    assert run([1, 2, 30, 4])[:2] == ([3, 6, 90, 12], [1, 2])  # what the changed run recorded


def test_a_journal_in_storage_no_plugin_serves_is_refused_at_the_first_call_saying_what_to_set(run_script) -> None:  # noqa: ANN001
    proc = run_script("""
        import fiber_core as mp

        if __name__ == "__main__":
            with mp.Pool(1) as pool:
                pool.map(abs, [-1])
    """, env={"FIBER_JOURNAL": "gs://bucket/run-1"})
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "fiber_core.base.errors.JournalError: journal='gs://bucket/run-1': no installed plugin serves "
        "this kind of storage (s3:// needs fiber-aws: pip install fiber-aws); or set journal to a local "
        "directory or one on a mounted volume that outlives the master")


# -- a program without a file ---------------------------------------------------------------


def test_a_program_without_a_file_is_refused_until_it_is_named_and_then_replays(tmp_path: Path) -> None:
    ran = tmp_path / "ran"
    code = ("import fiber_core as mp\n"
            "def f(x):\n"
            f"    open({str(ran)!r}, 'a').write(f'{{x}}\\n')\n"
            "    return -x\n"
            "with mp.Pool(2) as pool:\n"
            "    print(pool.map(f, range(6)))\n")

    def run(**extra: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "FIBER_JOURNAL": str(tmp_path / "journal"), **extra}
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=T)

    refused = run()
    assert refused.returncode == 1 and not ran.exists()
    assert refused.stderr.strip().splitlines()[-1].startswith(
        "fiber_core.base.errors.JournalError: a journal needs to know which program it belongs to")
    first = run(FIBER_PROGRAM="negate")
    assert first.returncode == 0, first.stderr
    assert first.stdout == "[0, -1, -2, -3, -4, -5]\n" and len(ran.read_text().split()) == 6
    again = run(FIBER_PROGRAM="negate")
    assert again.returncode == 0, again.stderr
    assert again.stdout == first.stdout and len(ran.read_text().split()) == 6


def test_a_journal_set_after_the_first_call_is_refused_saying_to_set_it_first(run_script, tmp_path: Path) -> None:  # noqa: ANN001
    proc = run_script(f"""
        import fiber_core as mp

        if __name__ == "__main__":
            with mp.Pool(1) as pool:
                pool.map(abs, [-1])
                mp.init(seed=3)  # another setting: nothing to say
                pool.map(abs, [-2])
                mp.init(journal={str(tmp_path / "journal")!r})
                pool.map(abs, [-3])
    """)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"fiber_core.base.errors.JournalError: journal was set to {str(tmp_path / 'journal')!r} after "
        "this program's first Pool or executor call (it was None then), and a journal records a "
        "program from its start: set it before the first call, and start the program again (in a "
        "notebook: in its first cell, then restart the kernel)")
    assert not (tmp_path / "journal").exists()
