"""A disk that fills under the run directory: the run goes on, every result once.

The run directory (the hub's socket, the jobs' logs, the status file) lives in the temp
dir. Here that is a 256 KiB tmpfs mounted by the test and filled to its last block before
the program makes anything of Fiber's, so every file Fiber writes there meets ENOSPC.

Mounting needs root (CI runs as root); a developer without it runs this file with
``sudo -E .venv/bin/python -m pytest tests/test_full_disk.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

T = 120.0  # bound of the program's run: reaching it is a hang, never a measure of speed

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (see the module's docstring)")

PROGRAM = textwrap.dedent("""
    import os, sys
    import fiber_core

    def square(x):
        print("x" * 2000, flush=True)  # the jobs' output, while nothing can be written there
        return x * x

    def talk(q):
        q.put("from the job")

    if __name__ == "__main__":
        filler = open(sys.argv[1], "wb", buffering=0)
        try:
            while True:
                filler.write(b"\\0" * 4096)
        except OSError:
            filler.close()
        print("free", os.statvfs(sys.argv[1]).f_bavail, file=sys.stderr, flush=True)
        with fiber_core.Pool(3) as pool:
            squares = pool.map(square, range(300), chunksize=1)
        q = fiber_core.Queue()
        p = fiber_core.Process(target=talk, args=(q,))
        p.start()
        got = q.get(timeout=60)
        p.join(60)
        print("result", squares == [x * x for x in range(300)], got, p.exitcode, file=sys.stderr)
""")


@pytest.fixture
def full_tmpdir(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "small"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=1777", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.parametrize("status", ["0", "1"])
def test_a_full_disk_under_the_run_directory_loses_no_result(tmp_path: Path, full_tmpdir: Path,
                                                             status: str) -> None:
    script = tmp_path / "full.py"
    script.write_text(PROGRAM)
    env = {**os.environ, "TMPDIR": str(full_tmpdir), "FIBER_STATUS": status}
    out = subprocess.run([sys.executable, str(script), str(full_tmpdir / "fill")], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=T)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "free 0" in out.stderr, out.stderr[-3000:]  # the disk was full before Fiber wrote anything
    assert "result True from the job 0" in out.stderr, out.stderr[-3000:]
    assert out.stdout.count("x" * 2000) == 300  # each task's output arrived, once
    assert os.listdir(full_tmpdir) == ["fill"]  # and the run left nothing behind
