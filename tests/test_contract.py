"""The job machinery the contract gives every backend: JobState, LogRing, Watcher, group starts."""

from __future__ import annotations

import ast
import sys
import threading
from pathlib import Path

import pytest

import fiber_core.contract as contract
from fiber_core.base.errors import BackendError
from fiber_core.contract import Backend, EndReason, Job, JobSpec, JobState, LogRing, Watcher

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]


def test_first_finish_wins_and_wakes_waiters() -> None:
    state = JobState()
    woke = threading.Event()

    def waiter() -> None:
        if state.wait(30):
            woke.set()

    t = threading.Thread(target=waiter)
    t.start()
    assert not state.done() and state.exitcode is None and state.reason is None
    assert state.finish(-9, EndReason.OOM, "limit 64 MiB") is True
    assert state.finish(0) is False  # a later report changes nothing
    t.join(30)
    assert woke.is_set()
    assert (state.exitcode, state.reason, state.detail) == (-9, EndReason.OOM, "limit 64 MiB")


@pytest.mark.parametrize("requested, code, reason", [
    (False, 0, EndReason.EXITED), (False, -15, EndReason.EXITED),
    (True, -15, EndReason.STOPPED), (True, -9, EndReason.STOPPED),
    (True, 3, EndReason.EXITED),  # asked to stop, but it exited by itself first
])
def test_the_default_reason_follows_who_asked_for_the_end(requested: bool, code: int,
                                                          reason: EndReason) -> None:
    state = JobState()
    state.stop_requested = requested
    state.finish(code)
    assert state.reason is reason


def test_which_reasons_are_not_the_jobs_fault() -> None:
    assert {r for r in EndReason if r.infrastructure} == {
        EndReason.STOPPED, EndReason.PREEMPTED, EndReason.HOST_LOST}


def test_log_ring_keeps_the_last_bytes() -> None:
    ring = LogRing(limit=10)
    ring.append(b"0123456789")
    ring.append("abc")
    assert ring.text() == "3456789abc"
    assert len(ring) == 10
    ring.append(b"\xff")  # not UTF-8: replaced, never an error
    assert ring.text().endswith("\ufffd")


def test_watcher_survives_failing_rounds_and_stops_when_asked() -> None:
    calls = 0
    done = threading.Event()

    def step() -> float | None:
        nonlocal calls
        calls += 1
        if calls <= 3:
            raise ConnectionError("cluster unreachable")  # backed off, then tried again
        done.set()
        watcher.stop()
        return 0.0

    watcher = Watcher(step, "test-watcher", interval=0.001, max_backoff=0.004)
    assert done.wait(30)
    assert watcher.stopped and calls == 4


def test_watcher_wake_runs_the_next_round_at_once() -> None:
    rounds = threading.Semaphore(0)
    watcher = Watcher(lambda: rounds.release() or 3600.0, "test-wake", interval=3600.0)
    try:
        assert rounds.acquire(timeout=30)  # the first round runs at start
        watcher.wake()
        assert rounds.acquire(timeout=30)  # not an hour later
    finally:
        watcher.stop()


class _Recorder(Backend):
    """A backend whose jobs never run: it records what Fiber asks of it."""

    name = "recorder"

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__({}, "run")
        self.fail_at = fail_at
        self.killed: list[str] = []

    def create_job(self, spec: JobSpec) -> Job:
        if spec.name == f"job-{self.fail_at}":
            raise BackendError("no capacity")
        return Job(id=spec.name, spec=spec)

    def terminate_job(self, job: Job) -> None:
        job.state.finish(-15)

    def kill_job(self, job: Job) -> None:
        self.killed.append(job.id)
        job.state.finish(-9)


def _specs(n: int) -> list[JobSpec]:
    return [JobSpec(command=[sys.executable, "-c", "pass"], name=f"job-{i}") for i in range(n)]


def test_start_jobs_tracks_every_job_in_order() -> None:
    b = _Recorder()
    jobs = b.start_jobs(_specs(3))
    assert [j.id for j in jobs] == ["job-0", "job-1", "job-2"]
    assert b.jobs == jobs


def test_create_jobs_is_all_or_nothing() -> None:
    b = _Recorder(fail_at=2)
    with pytest.raises(BackendError, match="no capacity"):
        b.start_jobs(_specs(4))
    assert b.killed == ["job-0", "job-1"]  # what the call had started is stopped again
    assert b.jobs == []


def test_stop_job_marks_the_end_as_fibers_own() -> None:
    b = _Recorder()
    job = b.start_job(_specs(1)[0])
    b.stop_job(job)
    assert (b.poll_job(job), b.end_reason(job)) == (-15, EndReason.STOPPED)
    assert b.wait_for_job(job, 0) == -15


def test_cleanup_kills_what_runs_and_untracks_everything() -> None:
    b = _Recorder()
    running, ended = b.start_jobs(_specs(2))
    ended.state.finish(0)
    b.cleanup()
    assert b.killed == [running.id]
    assert running.state.reason is EndReason.STOPPED
    assert b.jobs == []


def test_a_backend_made_by_hand_gets_a_private_directory_that_cleanup_removes() -> None:
    import os

    b = _Recorder()
    path = b.rundir
    assert os.path.isdir(path) and oct(os.stat(path).st_mode & 0o777) == "0o700"
    b.cleanup()
    assert not os.path.exists(path)


def test_wait_for_job_times_out_while_the_job_runs() -> None:
    b = _Recorder()
    job = b.start_job(_specs(1)[0])
    assert b.wait_for_job(job, 0.01) is None
    assert b.get_job_logs(job) == ""  # no output yet is no logs, not an error


def test_every_exported_name_resolves() -> None:
    for name in contract.__all__:
        assert getattr(contract, name) is not None
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        contract.Nope  # noqa: B018


def test_a_job_started_after_cleanup_is_stopped_and_refused() -> None:
    b = _Recorder()
    b.cleanup()  # the program is exiting; a pool's master may still try to replace a worker
    with pytest.raises(BackendError, match="cleaned up"):
        b.start_job(_specs(1)[0])
    assert b.killed == ["job-0"] and b.jobs == []


def test_a_group_members_token_derives_from_the_group_and_its_index() -> None:
    from fiber_core.contract.env import group_token, job_token

    tokens = {group_token("secret", i) for i in range(100)}
    assert len(tokens) == 100 and group_token("secret", 3) == group_token("secret", 3)
    assert group_token("other", 3) != group_token("secret", 3)
    assert job_token({"FIBER_PROCESS_TOKEN": "own", "FIBER_GROUP": "secret", "FIBER_GROUP_INDEX": "3"}) == "own"
    # An array job's child has no token of its own, only the group and its index.
    assert job_token({"FIBER_GROUP": "secret", "FIBER_GROUP_INDEX": "3"}) == group_token("secret", 3)
    with pytest.raises(KeyError, match="not started by Fiber"):
        job_token({"FIBER_GROUP": "secret", "FIBER_GROUP_INDEX": ""})


# -- what the contract gives every backend: the live-job table, settings, helpers ------------


def test_a_job_leaves_the_live_table_when_its_state_finishes() -> None:
    b = _Recorder()
    first, second = b.start_jobs(_specs(2))
    assert b.job_by_id("job-0") is first and b.jobs == [first, second]
    first.state.finish(0)  # a watcher learnt of its end: nobody calls untrack_job
    assert b.job_by_id("job-0") is None and b.jobs == [second]


def test_a_job_tracked_early_is_found_by_id_before_fiber_tracks_it() -> None:
    b = _Recorder()
    job = Job(id="c1", spec=_specs(1)[0])
    b.track_job(job)
    assert b.job_by_id("c1") is job
    b._track([job])  # Fiber's own tracking after create_job: the same entry
    assert b.jobs == [job]


def test_a_done_callback_runs_once_at_the_end_or_at_once_when_it_has_ended() -> None:
    state, seen = JobState(), []
    state.add_done_callback(lambda s: seen.append(("before", s.exitcode)))
    state.finish(3)
    state.finish(4)
    state.add_done_callback(lambda s: seen.append(("after", s.exitcode)))
    assert seen == [("before", 3), ("after", 3)]


class _Configured(_Recorder):
    name = "configured"
    options = (contract.Option("api_timeout", float, 15.0), contract.TIMEOUT_ALIAS, contract.EXTRA_ENV,
               contract.Option("image", str, None), contract.Option("slots", int, 2))
    renamed_options = {"timeout": "api_timeout"}

    def __init__(self, settings: dict[str, object]) -> None:
        Backend.__init__(self, settings, "run")


def test_settings_are_complete_and_typed_when_the_backend_is_made() -> None:
    b = _Configured({"slots": "3", "extra_env": "A=1,B=2"})
    assert b.settings["slots"] == 3 and b.settings["api_timeout"] == 15.0 and b.api_timeout == 15.0
    assert b.settings["image"] is None and b.settings["extra_env"] == ["A=1", "B=2"]
    with pytest.raises(contract.ConfigError, match="slots"):
        _Configured({"slots": "many"})


def test_the_old_name_of_api_timeout_still_works_with_a_warning() -> None:
    with pytest.warns(FutureWarning, match="now called 'api_timeout'"):
        b = _Configured({"timeout": 60})
    assert b.api_timeout == 60.0
    with pytest.warns(FutureWarning):
        b = _Configured({"timeout": 60, "api_timeout": 5})
    assert b.api_timeout == 5.0  # the new name wins where both are set


def test_a_jobs_environment_is_extra_env_under_its_own_and_its_secrets_are_told_apart() -> None:
    b = _Configured({"extra_env": ["A=1", "B=x=y"]})
    spec = JobSpec(command=["true"], env={"B": "2", "FIBER_AUTHKEY": "k", "FIBER_PROCESS_TOKEN": "t"})
    env = b.job_env(spec)
    assert env == {"A": "1", "B": "2", "FIBER_AUTHKEY": "k", "FIBER_PROCESS_TOKEN": "t"}
    assert contract.split_secrets(env) == ({"A": "1", "B": "2"}, {"FIBER_AUTHKEY": "k", "FIBER_PROCESS_TOKEN": "t"})
    with pytest.raises(contract.ConfigError, match="KEY=VALUE"):
        _Configured({"extra_env": ["nope"]}).job_env(spec)


def test_a_jobs_image_comes_from_the_spec_then_the_setting_else_an_error_says_what_to_set() -> None:
    b = _Configured({"image": "mine:1"})
    assert b.job_image(JobSpec(command=[], image="theirs:2")) == "theirs:2"
    assert b.job_image(JobSpec(command=[])) == "mine:1"
    assert _Configured({}).job_image(JobSpec(command=[]), default="own:3") == "own:3"
    with pytest.raises(BackendError, match="FIBER_CONFIGURED_IMAGE.*pip"):
        _Configured({}).job_image(JobSpec(command=[]), hint="; pip install fiber-core")


@pytest.mark.parametrize("gpu, gpu_type, count", [(None, None, 0), (0, None, 0), (2, None, 2),
                                                  (None, "a10g", 1), (4, "a10g", 4), (-1, None, -1)])
def test_a_gpu_type_alone_asks_for_one_gpu(gpu: int | None, gpu_type: str | None, count: int) -> None:
    assert contract.gpu_count(JobSpec(command=[], gpu=gpu, gpu_type=gpu_type)) == count


def test_a_name_is_cleaned_to_what_the_platform_accepts() -> None:
    assert contract.clean_name("Process-1:2 weird/name") == "Process-1-2-weird-name"
    assert contract.clean_name("Process-1:2", "a-z0-9-", lower=True) == "process-1-2"
    assert contract.clean_name("..//..") == "job" and contract.clean_name("", fallback="") == ""
    assert contract.clean_name("a" * 10 + "-b", limit=11) == "a" * 10


def test_remove_all_calls_every_removal_and_returns_the_errors() -> None:
    removed: list[int] = []

    def remove(n: int) -> None:
        if n == 3:
            raise OSError("busy")
        removed.append(n)

    errors = contract.remove_all(range(40), remove, limit=8)
    assert sorted(removed) == [n for n in range(40) if n != 3]
    assert [str(e) for e in errors] == ["busy"]


def _fiber_imports(path: Path) -> set[str]:
    """Every ``fiber_core`` module ``path`` imports, those for type checkers and in functions included."""
    def is_module(name: str) -> bool:
        where = REPO.joinpath(*name.split("."))
        return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(f"{node.module}.{alias.name}" if is_module(f"{node.module}.{alias.name}")
                         else node.module for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.split(".")[0] == "fiber_core"}


def test_the_contracts_modules_import_only_the_base_and_each_other_without_a_cycle() -> None:
    # lint-imports leaves out imports for type checkers; a cycle through one is a cycle still.
    package = REPO / "fiber_core" / "contract"
    graph = {f"fiber_core.contract.{p.stem}": _fiber_imports(p) for p in package.glob("*.py") if p.stem != "__init__"}
    for module, imported in graph.items():
        assert all(name.startswith(("fiber_core.base.", "fiber_core.contract.")) for name in imported), (
            module, imported)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph.get(start, ()))

    assert [m for m in graph if reaches(m, m, set())] == []

def test_each_plugins_import_contract_forbids_all_of_the_core_but_the_contract_and_testing() -> None:
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    forbidden = {tuple(c["source_modules"]): set(c["forbidden_modules"]) for c in contracts
                 if c["type"] == "forbidden"}
    core = REPO / "fiber_core"
    parts = {f"fiber_core.{p.stem}" for p in core.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    plugins = sorted(p.name for p in (REPO / "plugins").glob("*/fiber_*") if (p / "__init__.py").is_file())
    assert plugins == ["fiber_aws", "fiber_docker", "fiber_k8s", "fiber_ssh"]
    for plugin in plugins:
        assert forbidden.get((plugin,)) == parts - {"fiber_core.contract", "fiber_core.testing"}, plugin
