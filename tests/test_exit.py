"""The exit sequence of a program: non-daemon children are waited for before any exit
handler an SDK registered runs, and SIGTERM runs the same cleanup as a normal exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from procs import alive

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed


def _start(tmp_path: Path, code: str) -> subprocess.Popen:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(code))
    return subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, env=os.environ.copy())


def _ready(proc: subprocess.Popen) -> dict[str, str]:
    """The ``key value`` lines the program prints up to ``ready``."""
    seen: dict[str, str] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        key, _, value = line.strip().partition(" ")
        if key == "ready":
            return seen
        seen[key] = value
    proc.wait(T)
    raise AssertionError(f"the program ended before it was ready: {proc.stderr.read() if proc.stderr else ''}")


def test_a_non_daemon_child_finishes_before_exit_handlers_registered_after_it_run(run_script) -> None:  # noqa: ANN001
    # The atexit handler registered after the child started stands for an SDK's (a client
    # deleting its temporary files, closing its connections): Fiber's exit must be done by then.
    out = run_script("""
        import atexit, os, time
        import fiber_core

        def work(path):
            time.sleep(1)  # outlives the main code (the parent does not wait for it there)
            with open(path, "w") as f:
                f.write("done")

        if __name__ == "__main__":
            p = fiber_core.Process(target=work, args=("result",))
            p.start()
            atexit.register(lambda: print("at sdk exit:", os.path.exists("result"),
                                          fiber_core.active_children(), flush=True))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["at sdk exit: True []"], out.stderr


@pytest.mark.parametrize("daemon", [False, True])
def test_sigterm_stops_the_children_removes_the_run_and_ends_by_the_signal(tmp_path: Path, daemon: bool) -> None:
    proc = _start(tmp_path, f"""
        import time
        import fiber_core
        from fiber_core.runtime.run import runtime

        if __name__ == "__main__":
            p = fiber_core.Process(target=time.sleep, args=(600,), daemon={daemon})
            p.start()
            print("pid", p.pid)
            print("rundir", runtime().rundir)
            try:
                print("ready", flush=True)  # in the try: SIGTERM may come before p.join()
                p.join()
            finally:
                print("finally ran", flush=True)
    """)
    try:
        seen = _ready(proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=T)
    finally:
        proc.kill()
        proc.wait(T)
    assert proc.returncode == -signal.SIGTERM, err
    assert "finally ran" in out
    assert "Traceback" not in err, err
    assert not alive(int(seen["pid"]))
    assert not os.path.exists(seen["rundir"])


def test_sigterm_leaves_a_handler_of_the_program_alone(tmp_path: Path) -> None:
    proc = _start(tmp_path, """
        import signal, sys, time
        import fiber_core

        if __name__ == "__main__":
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
            p = fiber_core.Process(target=time.sleep, args=(600,), daemon=True)
            p.start()
            print("pid", p.pid)
            print("ready", flush=True)
            p.join()
    """)
    try:
        seen = _ready(proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=T)
    finally:
        proc.kill()
        proc.wait(T)
    assert proc.returncode == 7, err
    assert not alive(int(seen["pid"]))  # the normal exit stopped the daemonic child


def test_a_child_forked_by_other_code_does_not_end_the_run(run_script) -> None:  # noqa: ANN001
    # multiprocessing's fork Pool stops its workers with SIGTERM; they are copies of this
    # process, with Fiber's SIGTERM handler: they must not run the run's exit sequence.
    out = run_script("""
        import multiprocessing
        import fiber_core

        def square(x):
            return x * x

        if __name__ == "__main__":
            with fiber_core.Pool(2) as pool:
                assert pool.map(square, range(4)) == [0, 1, 4, 9]
                with multiprocessing.get_context("fork").Pool(2) as forked:
                    assert forked.map(square, range(4)) == [0, 1, 4, 9]
                # terminated by SIGTERM now; the run's files and jobs are still here
                assert pool.map(square, range(8)) == [x * x for x in range(8)]
            with fiber_core.Pool(2) as pool:  # new workers reach this process
                print(pool.map(square, range(3)), flush=True)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0, 1, 4]", out.stderr


def test_a_manager_not_shut_down_is_shut_down_at_exit(run_script) -> None:  # noqa: ANN001
    # As multiprocessing does at exit: the manager's finalizer runs before the children are
    # joined, so its server job ends instead of being waited for forever.
    out = run_script("""
        import fiber_core

        if __name__ == "__main__":
            m = fiber_core.Manager()
            d = m.dict()
            d["x"] = 1
            print("server", m._process.pid, dict(d), flush=True)
    """, timeout=T)
    assert out.returncode == 0, out.stderr
    key, pid, rest = out.stdout.split(" ", 2)
    assert (key, rest.strip()) == ("server", "{'x': 1}"), out.stdout
    assert not alive(int(pid))


def test_what_pool_tasks_printed_arrives_though_the_pool_is_terminated_after_its_results(run_script) -> None:  # noqa: ANN001
    # terminate() kills the workers at once: what a task printed must have reached the parent
    # before its result did (the stdlib's workers write straight to the inherited stdout).
    out = run_script("""
        import fiber_core

        def shout(x):
            print("line", x, "x" * 2000, flush=True)
            return x

        if __name__ == "__main__":
            for _ in range(5):
                pool = fiber_core.Pool(3)
                assert pool.map(shout, range(200), chunksize=1) == list(range(200))
                pool.terminate()
                pool.join()
    """, timeout=4 * T)
    assert out.returncode == 0, out.stderr
    lines = [ln.split(" ")[2] for ln in out.stdout.splitlines() if ln.endswith("x" * 2000)]
    assert sorted(map(int, lines)) == sorted(list(range(200)) * 5), f"{len(lines)} of 1000 lines"
