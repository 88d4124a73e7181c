"""What another local user of a shared host can do to a running program's hub, status page and ``fiber top``.

The other user is played for real (``nobody``, through :mod:`tenant`): it floods the hub's
TCP port and the status page with idle connections while the program works. ``fiber top``
is run as the docs say, beside a real program whose process names and worker errors hold
escape sequences. ``T`` bounds every wait: reaching it is a failure, never a measure of speed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed


class Program:
    """A script run with ``FIBER_STATUS=1`` in a temporary directory of its own (its ``TMPDIR``).

    The script prints ``run <id>`` once it is ready, then waits for its standard input to
    close.
    """

    def __init__(self, tmp_path: Path, code: str, env: dict[str, str] | None = None) -> None:
        self.tmpdir = tempfile.mkdtemp(prefix="ften-")  # short: the hub's socket path is in it
        self.env = {**os.environ, "TMPDIR": self.tmpdir, **(env or {})}
        script = tmp_path / "program.py"
        script.write_text(code)
        self.proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     cwd=tmp_path, env={**self.env, "FIBER_STATUS": "1"})
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("run "):
            _, err = self.stop()
            pytest.fail(f"the program did not start: {line!r}\n{err[-3000:]}")
        self.run_id = line.split()[1]
        self.rest = line.split()[2:]

    def stop(self) -> tuple[str, str]:
        """Close its input and wait for its end: what it wrote to stdout and stderr."""
        try:
            out, err = self.proc.communicate(timeout=3 * T)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        finally:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
        return out, err


@pytest.fixture
def programs(tmp_path: Path) -> Iterator[list[Program]]:
    started: list[Program] = []
    try:
        yield started
    finally:
        for p in started:
            if p.proc.returncode is None:
                p.stop()


# -- fiber top: what the program sends is shown, never obeyed -------------------------------------

_HOSTILE_PROGRAM = r'''
import os, sys, threading
import fiber_core
from fiber_core.runtime.run import runtime

HOSTILE = "\x1b]0;owned\x07\x1b[2J\x1b[H\x9b31m\u202e\x7f\x00"


def hostile_start():
    sys.stderr.write(HOSTILE + "worker error\n")
    sys.stderr.flush()
    os._exit(3)


def hold():
    threading.Event().wait(60)


if __name__ == "__main__":
    p = fiber_core.Process(target=hold, name=HOSTILE + "named", daemon=True)
    p.start()
    pool = fiber_core.Pool(1, initializer=hostile_start)
    try:
        pool.apply(len, ((),))
    except Exception as e:
        print(type(e).__name__, file=sys.stderr)
    print("run", runtime().run_id, flush=True)
    sys.stdin.read()
'''

_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u202e]")  # every control but the newline


def test_fiber_top_shows_escape_sequences_in_names_and_worker_errors_as_plain_text(
        tmp_path: Path, programs: list[Program]) -> None:
    program = Program(tmp_path, _HOSTILE_PROGRAM)
    programs.append(program)
    shown = subprocess.run([sys.executable, "-m", "fiber_core.cli", "top", "--once", program.run_id],
                           capture_output=True, text=True, env=program.env, timeout=T)
    assert shown.returncode == 0, shown.stderr
    assert _CONTROL.findall(shown.stdout) == []
    # What was around the escapes is still there to read.
    assert re.search(r"^\s+\?+named\s+local\s", shown.stdout, re.M), shown.stdout
    assert re.search(r"failed .*the end of its log: \?+worker error$", shown.stdout, re.M), shown.stdout
