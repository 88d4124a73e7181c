"""Spare jobs (fiber_core.processes.spares) on the local backend, where they are off unless
``spare_jobs`` is set: a start lands on a ready spare, and only when the spare is of the
same kind and was sent the same prelude; spares end cleanly when let go, timed out or dead."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator

import pytest
from procs import wait_gone

import fiber_core
from fiber_core.base.errors import ConfigError
from fiber_core.processes import spares
from fiber_core.processes.process import start_processes
from fiber_core.runtime.run import runtime

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed


def report(q: fiber_core.Queue, code: int) -> None:
    print("spare output", flush=True)
    q.put((os.getpid(), fiber_core.current_process().name, sys.modules["__main__"].__name__, sys.argv))
    sys.exit(code)


@pytest.fixture
def with_spares() -> Iterator[None]:
    fiber_core.init(spare_jobs=1)
    yield
    spares.release(T)
    assert spares.ready_jobs() == []


def start_one(code: int = 0) -> tuple[fiber_core.Process, tuple]:
    q = fiber_core.Queue()
    p = fiber_core.Process(target=report, args=(q, code))
    p.start()
    got = q.get(timeout=T)
    p.join(T)
    assert p.exitcode == code
    return p, got


def one_ready() -> spares.Job:
    assert spares.settle(T)
    ready = spares.ready_jobs()
    assert len(ready) == 1
    return ready[0]


def test_a_start_lands_on_the_ready_spare(with_spares: None, capfd: pytest.CaptureFixture) -> None:
    first, (_, _, cold_main, cold_argv) = start_one()
    spare = one_ready()
    assert spare is not first.job and spares.ready_jobs() == [spare]
    p, (pid, name, main, argv) = start_one(code=3)
    assert p.job is spare and p.pid == pid == int(spare.id)
    assert name == p.name and p.job.spec.name == p.name  # it runs that process now
    assert (main, argv) == (cold_main, cold_argv) and argv == sys.argv  # as a job started for it
    assert capfd.readouterr().out.count("spare output") == 2  # its output forwarded as any job's
    again = one_ready()  # a new spare replaces the one used
    assert again is not spare


@pytest.mark.parametrize("change", ["config", "sys.path"])
def test_a_spare_sent_other_settings_is_not_used(with_spares: None, change: str,
                                                 monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    start_one()
    stale = one_ready()
    if change == "config":
        fiber_core.init(start_timeout=T)
    else:
        monkeypatch.syspath_prepend(str(tmp_path))
    p, (pid, *_rest) = start_one()
    assert p.job is not stale and pid != int(stale.id)
    backend = runtime().backend
    assert backend.wait_for_job(stale, T) == 0  # let go: its worker ran nothing and exited cleanly
    assert "Traceback" not in backend.get_job_logs(stale)
    assert one_ready() is not stale


def test_an_unused_spare_is_let_go_after_spare_timeout(with_spares: None) -> None:
    # Long enough that the spare, ready as soon as the process was sent, is still there
    # once start_one() returns; short enough for a test.
    fiber_core.init(spare_timeout=3.0)
    start_one()
    spare = one_ready()
    assert runtime().backend.wait_for_job(spare, T) == 0
    assert spares.ready_jobs() == []


def test_a_spare_that_died_is_not_used(with_spares: None) -> None:
    start_one()
    spare = one_ready()
    os.kill(int(spare.id), signal.SIGKILL)
    wait_gone(int(spare.id))
    p, (pid, *_rest) = start_one(code=5)
    assert p.job is not spare and pid == p.pid


def test_a_group_start_takes_the_ready_spare_as_a_worker(with_spares: None) -> None:
    start_one()
    spare = one_ready()
    with fiber_core.Pool(3) as pool:
        assert spare in [w.process.job for w in pool._workers.values()]
        assert spares.ready_jobs() == []
        assert pool.map(abs, range(-20, 0)) == list(range(20, 0, -1))
    assert spares.settle(T) and spares.ready_jobs() == []  # a pool starts no spare


def take(counted: Counted) -> None:
    assert isinstance(counted, Counted)


class Counted:
    """Counts how often the parent pickles it (a process object is pickled once per start)."""

    pickles = 0

    def __reduce__(self) -> tuple:
        type(self).pickles += 1
        return (Counted, ())


def test_a_group_start_of_another_kind_leaves_the_spare_and_pickles_once(with_spares: None) -> None:
    start_one()
    spare = one_ready()
    Counted.pickles = 0
    ps = [fiber_core.Process(target=take, args=(Counted(),), cpu=1) for _ in range(3)]
    start_processes(ps)
    for p in ps:
        p.join(T)
        assert p.exitcode == 0 and p.job is not spare
    # The first is pickled for the spare that turned out to be of another kind, then for its
    # job; the others only for theirs (each of them too, before).
    assert Counted.pickles == len(ps) + 1
    assert spares.ready_jobs() == [spare]


def test_no_spare_unless_the_backend_or_the_setting_asks() -> None:
    start_one()
    assert spares.settle(T) and spares.ready_jobs() == []
    assert runtime().backend.spare_jobs == 0


def test_a_negative_spare_jobs_is_refused_at_start() -> None:
    fiber_core.init(spare_jobs=-1)
    p = fiber_core.Process(target=report)
    routes = set(runtime().hub._routes)
    with pytest.raises(ConfigError, match=r"spare_jobs=-1: expected 0 \(no spare jobs\) or more"):
        p.start()
    assert p.job is None and set(runtime().hub._routes) == routes  # its route is gone again
    fiber_core.init(spare_jobs=0)
    start_one()  # nothing was lost: the next start works


@pytest.mark.parametrize("wait", [False, True])
def test_a_program_leaves_no_spare_behind(run_script, wait: bool) -> None:  # noqa: ANN001
    # Ending at once after a start, while its spare may still be starting, or after one is ready.
    r = run_script(f"""
        import fiber_core
        from fiber_core.processes import spares

        def hello():
            print("hello", flush=True)

        if __name__ == "__main__":
            fiber_core.init(spare_jobs=1)
            p = fiber_core.Process(target=hello)
            p.start()
            p.join()
            if {wait}:
                assert spares.settle(30)
                print("spare", spares.ready_jobs()[0].id, flush=True)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert "hello" in r.stdout
    pids = [int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("spare ")]
    assert len(pids) == wait
    for pid in pids:
        wait_gone(pid)


def test_a_spare_that_cannot_get_ready_is_not_tried_again(run_script, tmp_path) -> None:  # noqa: ANN001
    # The second job's interpreter (the spare started after the first) exits at once: that
    # kind of spare is given up, and the next start, which runs, starts none.
    python, calls = tmp_path / "python", tmp_path / "calls"
    python.write_text(f"""#!/bin/sh
echo x >> {calls}
[ "$(wc -l < {calls})" -eq 2 ] && exit 3
exec {sys.executable} "$@"
""")
    python.chmod(0o755)
    r = run_script(f"""
        import fiber_core
        from fiber_core.processes import spares

        def hello():
            pass

        if __name__ == "__main__":
            fiber_core.init(spare_jobs=1, python={str(python)!r})
            for _ in range(2):
                p = fiber_core.Process(target=hello)
                p.start()
                p.join(30)
                print("exit", p.exitcode, flush=True)
                assert spares.settle(30)
            print("ready", len(spares.ready_jobs()), flush=True)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:3] == ["exit 0", "exit 0", "ready 0"]
    assert calls.read_text().count("x") == 3  # the first, the spare that failed, the second
