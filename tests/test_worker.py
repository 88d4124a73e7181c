"""The worker bootstrap: output forwarded to the parent, and no job outliving its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from procs import alive

T = 30.0

TALKER = """
    import os, sys, fiber_core

    def grandchild():
        print("from the grandchild")

    def talk():
        print("to stdout")
        print("to stderr", file=sys.stderr)
        os.write(1, b"through fd 1\\n")
        g = fiber_core.Process(target=grandchild)
        g.start()
        g.join()
        sys.stdout.write("no newline at the end")

    if __name__ == "__main__":
        p = fiber_core.Process(target=talk, name="talker")
        p.start()
        p.join()
        print("parent done", p.exitcode)
"""


def test_output_is_forwarded_with_the_name(run_script) -> None:  # noqa: ANN001
    out = run_script(TALKER)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "parent done 0"  # join() returns after the child's output is printed
    assert set(lines[:-1]) == {
        "[talker] to stdout",
        "[talker] through fd 1",
        "[talker] [Process-1:1] from the grandchild",
        "[talker] no newline at the end",
    }
    assert lines.index("[talker] to stdout") < lines.index("[talker] through fd 1")
    assert "[talker] to stderr" in out.stderr.splitlines()
    assert "to stderr" not in out.stdout


def test_output_not_forwarded_when_disabled(run_script) -> None:  # noqa: ANN001
    out = run_script(TALKER, env={"FIBER_FORWARD_OUTPUT": "0"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["parent done 0"]
    assert "to stderr" not in out.stderr and "grandchild" not in out.stderr


ORPHANS = """
    import os, threading, fiber_core

    def grandchild(q):
        q.put(os.getpid())
        threading.Event().wait()

    def child(q):
        fiber_core.Process(target=grandchild, args=(q,)).start()
        q.put(os.getpid())
        threading.Event().wait()

    if __name__ == "__main__":
        q = fiber_core.Queue()
        for _ in range(2):
            fiber_core.Process(target=child, args=(q,)).start()
        for _ in range(4):
            print(q.get(timeout=30), flush=True)
        print("ready", flush=True)
        threading.Event().wait()
"""



def test_jobs_die_with_a_killed_parent(tmp_path: Path, own_tmpdir: str) -> None:
    script = tmp_path / "orphans.py"
    script.write_text(textwrap.dedent(ORPHANS))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "TMPDIR": own_tmpdir})
    pids: list[int] = []
    try:
        for line in parent.stdout:  # the test's timeout bounds this if the script misbehaves
            if line.strip() == "ready":
                break
            pids.append(int(line))
        assert len(pids) == 4 and all(map(alive, pids))
        parent.kill()
        parent.wait(T)
        deadline = time.monotonic() + T
        while any(map(alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling an OS fact, bounded by the deadline
        assert [pid for pid in pids if alive(pid)] == []
    finally:
        parent.kill()
        parent.wait(T)
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_worker_run_by_hand_explains_itself() -> None:
    out = subprocess.run([sys.executable, "-m", "fiber_core.processes.worker"], capture_output=True, text=True,
                         timeout=T)
    assert out.returncode == 2
    assert "run by fiber jobs only" in out.stderr


UNLOADABLE = """
    import fiber_core

    def explode():
        raise RuntimeError("cannot be rebuilt here")

    class Unloadable:
        def __reduce__(self):
            return (explode, ())

    if __name__ == "__main__":
        p = fiber_core.Process(target=print, args=(Unloadable(),), name="loader")
        p.start()
        p.join(30)
        print("exitcode", p.exitcode)
"""


def test_a_payload_that_fails_to_load_is_explained_in_the_parent(run_script) -> None:  # noqa: ANN001
    out = run_script(UNLOADABLE)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["exitcode 1"]
    err = out.stderr.splitlines()
    assert "[loader] fiber worker: cannot load the process to run:" in err
    assert "[loader] RuntimeError: cannot be rebuilt here" in err


LEAN = """
    import os, sys, fiber_core

    COUNT = 0

    def report(q):
        global COUNT
        COUNT += 1
        # The job's main module is this file, imported as __mp_main__: a function's globals
        # are that module's, as in any imported module.
        q.put((os.getppid(), sorted(set(sys.modules) & set(sys.argv[1].split(","))),
               sys.modules["__mp_main__"].COUNT))

    if __name__ == "__main__":
        q = fiber_core.Queue()
        p = fiber_core.Process(target=report, args=(q,))
        p.start()
        ppid, loaded, count = q.get(timeout=30)
        p.join()
        print(ppid == os.getpid(), loaded, count)
"""


def test_a_job_starts_without_what_it_does_not_use(tmp_path: Path) -> None:
    # Started as a new interpreter (as on every remote backend), a job imports none of the
    # modules that only some calls need: each costs every job's start a millisecond or more.
    (tmp_path / "script.py").write_text(textwrap.dedent(LEAN))
    unwanted = ("configparser,json,pkgutil,tempfile,shutil,subprocess,logging,dataclasses,inspect,"
                "hashlib,hmac,_hashlib,typing,traceback,unicodedata,fiber_core.processes.pipe,fiber_core.parallel.context")
    out = subprocess.run([sys.executable, "script.py", unwanted], capture_output=True, text=True,
                         cwd=tmp_path, timeout=2 * T, env={**os.environ, "FIBER_LOCAL_START": "fresh"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "[]", "1"]  # the parent's child, lean, globals shared


POOL_LEAN = """
    import sys, fiber_core

    def loaded(names):
        return sorted(set(sys.modules) & set(names))

    def fail():
        raise ValueError("as planned")

    if __name__ == "__main__":
        names = ["traceback", "tokenize", "textwrap", "typing"]
        with fiber_core.Pool(1) as pool:
            print(pool.apply(loaded, (names,)))
            try:
                pool.apply(fail)
            except ValueError as e:
                print("raised", e.__cause__ is not None)
            print(pool.apply(loaded, (names,)))
"""


def test_a_pool_worker_loads_what_a_traceback_needs_at_its_first_error(tmp_path: Path) -> None:
    # traceback, with the tokenizer and textwrap it brings, is 2 ms of a new interpreter's
    # start: a worker imports it when a task first raises, and the error still comes with
    # the worker's traceback. typing (3 ms with the Task record) it never needs.
    (tmp_path / "script.py").write_text(textwrap.dedent(POOL_LEAN))
    out = subprocess.run([sys.executable, "script.py"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=2 * T, env={**os.environ, "FIBER_LOCAL_START": "fresh"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "[]", "raised True", "['textwrap', 'tokenize', 'traceback']"]
