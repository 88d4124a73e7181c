"""What a run leaves in the temp dir: nothing, after a clean exit, an exception or a SIGKILL.

Each program runs in a fresh interpreter with a temp dir of its own (``TMPDIR``), so what
it leaves there is exactly what the test sees.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from procs import wait_gone

from fiber_core.base import rundirs

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed

# Every kind of process a program makes, and a Process that starts its own Process.
PROGRAM = """
    import os, sys, threading
    import fiber_core

    def inner(q):
        q.put(os.getpid())
        if WAIT:
            threading.Event().wait()  # until the parent is killed

    def outer(q):
        p = fiber_core.Process(target=inner, args=(q,))
        p.start()
        q.put(os.getpid())
        m = fiber_core.Manager()  # its server is a job of this job; not shut down
        m.dict()["x"] = 1
        q.put(m._process.pid)
        p.join()

    def square(x):
        return x * x

    if __name__ == "__main__":
        q = fiber_core.Queue()
        p = fiber_core.Process(target=outer, args=(q,))
        p.start()
        with fiber_core.Pool(2) as pool:
            assert pool.map(square, range(10)) == [x * x for x in range(10)]
        lock, value = fiber_core.Lock(), fiber_core.Value("i", 1)
        with lock:
            value.value += 1
        pids = [q.get(timeout=30) for _ in range(3)]
        print("pids", " ".join(map(str, pids)), flush=True)
        END
"""


def _program(tmp_path: Path, wait: bool, end: str) -> Path:
    script = tmp_path / "app.py"
    code = textwrap.dedent(PROGRAM).replace("WAIT", repr(wait)).replace("END", end)
    script.write_text(code)
    return script


def _env(tempdir: Path) -> dict[str, str]:
    return {**os.environ, "TMPDIR": str(tempdir)}


@pytest.fixture
def tempdir(own_tmpdir: str) -> Path:
    """The temp dir of this test's programs (``TMPDIR``)."""
    return Path(own_tmpdir)


def _left(tempdir: Path) -> list[str]:
    return sorted(os.listdir(tempdir))



def test_nothing_is_left_after_a_clean_exit(tmp_path: Path, tempdir: Path) -> None:
    script = _program(tmp_path, wait=False, end="p.join(); print('exit', p.exitcode)")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                         env=_env(tempdir), timeout=2 * T)
    assert out.returncode == 0, out.stderr
    assert "exit 0" in out.stdout, out.stdout + out.stderr
    assert _left(tempdir) == [], out.stderr


def test_nothing_is_left_after_a_process_that_starts_a_process(tmp_path: Path, tempdir: Path) -> None:
    script = tmp_path / "nested.py"
    script.write_text(textwrap.dedent("""
        import fiber_core
        from fiber_core.runtime.run import runtime

        def inner():
            pass

        def outer():
            print("rundir", runtime().rundir, flush=True)  # where its child's files are
            p = fiber_core.Process(target=inner)
            p.start()
            p.join()

        if __name__ == "__main__":
            p = fiber_core.Process(target=outer)
            p.start()
            p.join()
            print("exit", p.exitcode, flush=True)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                         env=_env(tempdir), timeout=2 * T)
    assert out.returncode == 0, out.stderr
    assert "exit 0" in out.stdout, out.stdout + out.stderr
    # The child kept its run files inside its parent's run directory.
    [line] = [x for x in out.stdout.splitlines() if "rundir" in x]
    rundir = Path(line.split()[-1])
    assert rundir.parent.parent == tempdir and rundir.parent.name.startswith("fiber-"), line
    assert _left(tempdir) == [], out.stderr


def test_nothing_is_left_after_an_exception(tmp_path: Path, tempdir: Path) -> None:
    script = _program(tmp_path, wait=False, end="raise RuntimeError('the program fails')")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                         env=_env(tempdir), timeout=2 * T)
    assert out.returncode == 1 and "RuntimeError: the program fails" in out.stderr, out.stderr
    assert _left(tempdir) == [], out.stderr


def test_a_killed_runs_files_go_at_the_next_start_and_a_live_runs_stay(tmp_path: Path, tempdir: Path) -> None:
    script = _program(tmp_path, wait=True, end="threading.Event().wait()  # until killed")
    killed = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=tmp_path, env=_env(tempdir))
    try:
        assert killed.stdout is not None
        line = killed.stdout.readline()
        assert line.startswith("pids "), line + (killed.stderr.read() if killed.stderr else "")
        jobs = [int(x) for x in line.split()[1:]]
        [dead_run] = _left(tempdir)
        killed.send_signal(signal.SIGKILL)
        killed.wait(T)
    finally:
        killed.kill()
        killed.wait(T)
    for pid in jobs:  # the jobs end with their parent
        wait_gone(pid)
    assert _left(tempdir) == [dead_run]  # SIGKILL leaves it; the next run removes it

    # The next run removes it, and keeps its own while another run starts, cleans and ends.
    live = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys
        import fiber_core
        from fiber_core.runtime.run import runtime

        if __name__ == "__main__":
            for _ in range(2):
                p = fiber_core.Process(target=print, args=("child ran",))
                p.start()
                p.join()
                assert p.exitcode == 0
                print("rundir", runtime().rundir, flush=True)
                sys.stdin.readline()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=tmp_path, env=_env(tempdir))
    try:
        assert live.stdout is not None and live.stdin is not None
        line = live.stdout.readline()
        while not line.startswith("rundir"):
            assert line, live.stderr.read() if live.stderr else ""
            line = live.stdout.readline()
        live_dir = line.split()[-1]
        assert _left(tempdir) == [os.path.basename(live_dir)]  # its start removed the dead run's

        nxt = subprocess.run([sys.executable, "-c", "import fiber_core\n"
                              "p = fiber_core.Process(target=abs, args=(1,)); p.start(); p.join()\n"
                              "assert p.exitcode == 0"],
                             capture_output=True, text=True, cwd=tmp_path, env=_env(tempdir), timeout=2 * T)
        assert nxt.returncode == 0, nxt.stderr
        assert _left(tempdir) == [os.path.basename(live_dir)]  # another start left the live run's alone

        live.stdin.write("\n")
        live.stdin.flush()  # the live run starts another process: its files are still all there
        line = live.stdout.readline()
        while not line.startswith("rundir"):
            assert line, live.stderr.read() if live.stderr else ""
            line = live.stdout.readline()
        live.stdin.write("\n")
        live.stdin.flush()
        _, err = live.communicate(timeout=2 * T)
        assert live.returncode == 0, err
    finally:
        live.kill()
        live.wait(T)
    assert _left(tempdir) == []


def test_stale_run_directories_are_told_apart(tmp_path: Path, tempdir: Path) -> None:
    """Only a run directory whose lock nobody holds is removed; a directory without a lock
    file (another program's, or one being made) and a live one are left alone."""
    foreign = tempdir / "fiber-not-a-run"
    foreign.mkdir()
    (tempdir / "fiber-a-file").write_text("x")
    dead = tempdir / "fiber-dead"
    dead.mkdir()
    (dead / rundirs.LOCK).write_text("")
    (dead / "hub.sock").write_text("")
    held = subprocess.Popen([sys.executable, "-c", "import fiber_core.base.rundirs as r, sys\n"
                             "print(r.make('fiber-held-'), flush=True); sys.stdin.readline()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(tempdir))
    try:
        assert held.stdout is not None and held.stdin is not None
        live = Path(held.stdout.readline().strip())
        assert live.parent == tempdir and (live / rundirs.LOCK).exists()
        assert rundirs.remove_stale(str(tempdir)) == [str(dead)]
        assert _left(tempdir) == sorted(["fiber-not-a-run", "fiber-a-file", live.name])
        held.stdin.write("\n")
        held.stdin.flush()
        held.wait(T)  # it ended without removing its directory (as after SIGKILL)
        assert held.returncode == 0
    finally:
        held.kill()
        held.wait(T)
    assert rundirs.remove_stale(str(tempdir)) == [str(live)]
    assert _left(tempdir) == ["fiber-a-file", "fiber-not-a-run"]


@pytest.mark.parametrize("inside", [False, True])
def test_a_run_directory_is_private(tmp_path: Path, tempdir: Path, inside: bool) -> None:
    base = tempdir
    path = rundirs.make("fiber-x-", str(base) if inside else None)
    try:
        assert os.stat(path).st_mode & 0o777 == 0o700
        assert (Path(path).parent == base) is inside
    finally:
        rundirs.remove(path)
    assert not os.path.exists(path)
    assert rundirs.usable(str(base)) == str(base)
    assert rundirs.usable(str(tmp_path / "missing")) is None
    (tmp_path / "link").symlink_to(base)
    assert rundirs.usable(str(tmp_path / "link")) is None
