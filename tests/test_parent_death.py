"""A local job ends with its parent even inside a long call that holds the interpreter."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed

_PARENT = """
import ctypes, os, sys
import fiber_core
from fiber_core.runtime.run import runtime

def in_c(q):
    q.put(os.getpid())
    ctypes.PyDLL(None).sleep(int(sys.argv[1]))  # a C call that keeps the GIL

if __name__ == "__main__":
    fiber_core.init(local_start=sys.argv[2])
    if sys.argv[2] == "template":
        assert runtime().backend.wait_template(30)  # the job is forked from it
    q = fiber_core.Queue()
    p = fiber_core.Process(target=in_c, args=(q,))
    p.start()
    print(q.get(timeout=30), flush=True)
    p.join()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start", ["template", "fresh"])
def test_a_job_inside_a_long_c_call_ends_when_its_parent_is_killed(tmp_path: Path, start: str,
                                                                   own_tmpdir: str) -> None:
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    # The C call outlasts the wait below: the job must be ended, not finish by itself.
    parent = subprocess.Popen([sys.executable, str(script), str(int(3 * T)), start], stdout=subprocess.PIPE,
                              text=True, cwd=tmp_path, env={**os.environ, "TMPDIR": own_tmpdir})
    job = None
    try:
        assert parent.stdout is not None
        job = int(parent.stdout.readline())
        # Forked from the template, the job is not its parent's child; started fresh, it is.
        assert (int(Path(f"/proc/{job}/stat").read_text().rsplit(")", 1)[1].split()[1]) == parent.pid) == (
            start == "fresh")
        pidfd = os.pidfd_open(job)  # readable once the job has ended, reaped or not
        try:
            os.kill(parent.pid, signal.SIGKILL)
            parent.wait(T)
            ended, _, _ = select.select([pidfd], [], [], T)
        finally:
            os.close(pidfd)
        assert ended, "the job outlived its killed parent"
        job = None
    finally:
        parent.kill()
        parent.wait()
        if job is not None:
            try:
                os.killpg(job, signal.SIGKILL)
            except ProcessLookupError:
                pass
