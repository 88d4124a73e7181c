"""``fiber top`` in a real terminal (a pty) beside a program that maps on a pool while showing its state.

The program (tests/status_program.py) runs with ``FIBER_STATUS=1`` in a temporary directory
of its own, as ``TMPDIR``, which ``fiber top`` shares: there, its run is the only one and
so the newest. The terminal's screen is read from the pty's master side: each frame of
``fiber top`` starts with the cursor home and ends with clearing the rest of the screen.
``T`` bounds every wait: reaching it is a failure, never a measure of speed.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fiber_core.base.text import printable
from fiber_core.runtime.top import Cursor, render, sparkline, split_keys

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed
PROGRAM = Path(__file__).with_name("status_program.py")
COLUMNS, ROWS = 120, 40

_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_FRAME = re.compile(r"\x1b\[H(.*?)\x1b\[J", re.S)


class Program:
    """The program whose state is shown, and the environment ``fiber top`` shares with it."""

    def __init__(self, *args: str) -> None:
        # Short: the hub's Unix socket lives in a directory in it, and such paths are short.
        self.tmpdir = tempfile.mkdtemp(prefix="ftop-")
        self.env = {**os.environ, "TMPDIR": self.tmpdir}
        self.proc = subprocess.Popen([sys.executable, str(PROGRAM), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**self.env, "FIBER_STATUS": "1"})
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "run <id>" once the map runs
        while line.startswith("[PoolWorker-"):  # a worker's line, printed before it
            line = self.proc.stdout.readline()
        # The rest (the workers' lines) is read as it comes: a full pipe would stop the program.
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        if not line.startswith("run "):
            self.stop()
            pytest.fail(f"the program did not start: {line!r} {self.proc.stderr.read() if self.proc.stderr else ''}")
        self.run_id = line.split()[1]

    def stop(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()  # it terminates its pool and exits
        try:
            self.proc.wait(T)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(T)
            for stream in (self.proc.stdout, self.proc.stderr):
                if stream is not None:
                    stream.close()
            shutil.rmtree(self.tmpdir, ignore_errors=True)


@pytest.fixture
def program() -> Iterator[Program]:
    p = Program()
    try:
        yield p
    finally:
        p.stop()


class Terminal:
    """``fiber top`` on a pty of COLUMNS x ROWS; :meth:`screen` waits for a frame."""

    def __init__(self, env: dict[str, str], *args: str) -> None:
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
        self.proc = subprocess.Popen([sys.executable, "-m", "fiber_core.cli", "top", *args],
                                     stdin=slave, stdout=slave, stderr=slave, close_fds=True,
                                     start_new_session=True, env={**env, "TERM": "xterm"})
        os.close(slave)
        self.output = ""

    def _read(self, deadline: float) -> bool:
        """Read what the terminal got until ``deadline``; False at its end (the pty closed)."""
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([self.master], [], [], left)[0]:
            return True
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: every holder of the pty's other side is gone
            return False
        if not data:
            return False
        self.output += data.decode("utf-8", "replace")
        return True

    def screen(self, wanted: Callable[[list[str]], bool], what: str) -> list[str]:
        """The lines of the first new frame for which ``wanted`` is true (escapes removed)."""
        deadline = time.monotonic() + T
        seen = 0
        while time.monotonic() < deadline:
            frames = _FRAME.findall(self.output)
            for frame in frames[seen:]:
                lines = _ESCAPE.sub("", frame).replace("\r", "").split("\n")
                if wanted(lines):
                    return lines
            seen = len(frames)
            if not self._read(deadline):
                break
        pytest.fail(f"fiber top never showed {what}; the terminal got:\n{_ESCAPE.sub('', self.output)[-3000:]}")

    def rest(self) -> str:
        """Everything until the program on the pty ends."""
        deadline = time.monotonic() + T
        while time.monotonic() < deadline and self._read(deadline):
            if self.proc.poll() is not None and not select.select([self.master], [], [], 0)[0]:
                break
        return self.output

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(T)
        os.close(self.master)


def _busy_pool(run_id: str) -> Callable[[list[str]], bool]:
    def wanted(lines: list[str]) -> bool:
        text = "\n".join(lines)
        workers = [line for line in lines if re.match(r"\s+PoolWorker-\d+\s", line)]
        done = re.search(r"done (\d+)", text)
        return (f"run {run_id}" in lines[0] and len(workers) == 3
                and all(" busy " in w for w in workers) and done is not None and int(done.group(1)) > 0
                and "map(slow)" in text)
    return wanted


def test_fiber_top_in_a_terminal_shows_the_pools_workers_while_a_map_runs(program: Program) -> None:
    term = Terminal(program.env)  # no run id: the newest of this user's runs
    try:
        lines = term.screen(_busy_pool(program.run_id), "the pool's three workers busy")
        text = "\n".join(lines)
        assert "pool " in text and "3 workers  local  RUN" in text
        assert re.search(r"queued \d+  running \d+  done \d+  failed 0", text)
        assert re.search(r"\[#*\.+\]\s+\d+%  \d+/100000 tasks", text)
        header = next(line for line in lines if "WORKER" in line)
        assert header.split() == ["WORKER", "BACKEND", "HOST", "ID", "STATE", "FOR", "DONE", "IN", "FLIGHT"]
        for row in (line for line in lines if "PoolWorker-" in line):
            name, backend, host, pid = row.split()[:4]
            assert backend == "local" and host == os.uname().nodename and pid.isdigit()
        assert all(len(line) <= COLUMNS for line in lines)
        # It refreshes: a later frame has more tasks done.
        first = int(re.search(r"done (\d+)", text).group(1))  # type: ignore[union-attr]
        term.screen(lambda ls: int(re.search(r"done (\d+)", "\n".join(ls)).group(1)) > first,  # type: ignore[union-attr]
                    "more tasks done in a later frame")

        os.write(term.master, b"q")
        assert term.proc.wait(T) == 0
        rest = term.rest()
        assert rest.index("\x1b[?1049h") < rest.rindex("\x1b[?1049l")  # the screen is given back
        assert rest.endswith("\x1b[?25h\x1b[?1049l")  # the cursor too
    finally:
        term.close()

    # Once the program ends, fiber top says so and exits.
    term = Terminal(program.env, program.run_id[:6])
    try:
        term.screen(_busy_pool(program.run_id), "the pool again, by a prefix of its run id")
        program.stop()
        assert term.proc.wait(T) == 0
        assert f"fiber top: run {program.run_id} ended" in term.rest()
    finally:
        term.close()


def _fiber(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fiber_core.cli", *args], capture_output=True,
                          text=True, env=env, timeout=T)


def test_fiber_top_without_a_terminal_prints_one_plain_frame(program: Program) -> None:
    listed = _fiber(program.env, "top", "--list")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split("\n")[0].split() == ["RUN", "PID", "PROGRAM", "STARTED", "PAGE"]
    assert listed.stdout.split("\n")[1].split()[:3] == [program.run_id, str(program.proc.pid),
                                                        "status_program.py"]

    once = _fiber(program.env, "top", program.run_id)  # stdout is a pipe: one frame
    assert once.returncode == 0, once.stderr
    assert "\x1b" not in once.stdout
    assert once.stdout.startswith(f"fiber top  run {program.run_id}  status_program.py  pid {program.proc.pid}")
    assert len(re.findall(r"^\s+PoolWorker-\d+\s+local\s", once.stdout, re.M)) == 3

    unknown = _fiber(program.env, "top", "nosuchrun")
    assert unknown.returncode == 2
    assert "no running program of yours with run id 'nosuchrun' shows its state" in unknown.stderr
    assert program.run_id in unknown.stderr

    empty = Path(program.tmpdir, "empty")
    empty.mkdir()
    elsewhere = _fiber({**program.env, "TMPDIR": str(empty)}, "top")
    assert elsewhere.returncode == 2 and "start it with FIBER_STATUS=1" in elsewhere.stderr
    assert "--interval must be above 0" in _fiber(program.env, "top", "--interval", "0").stderr


# -- what the program sends is shown, never obeyed -----------------------------------------------


@pytest.mark.parametrize(("text", "shown"), [
    ("PoolWorker-1", "PoolWorker-1"),
    ("h\u00e9llo \u65e5\u672c \U0001f642 \u00a0", "h\u00e9llo \u65e5\u672c \U0001f642 \u00a0"),  # printable Unicode
    ("\x1b]0;owned\x07name", "?name"),  # an OSC title, ended by BEL
    ("\x1b]2;owned\x1b\\name", "?name"),  # ... or by ST
    ("\x1b[2J\x1b[Hx", "??x"),  # clear screen, cursor home
    ("a\x9b31mb", "a?b"),  # a C1 CSI
    ("\x1bP1$r\x1b\\after", "?after"),  # a DCS string
    ("\x1bc reset", "? reset"),  # a two-byte escape
    ("tail\x1b", "tail?"),
    ("\x7fdel\x00nul\x85nel", "?del?nul?nel"),  # DEL, C0, C1
    ("\u202eevil\u2028line", "?evil?line"),  # a bidi override, a line separator
    ("a\tb\nc\r\n", "a b c  "),  # tabs and line breaks: spaces
])
def test_printable_turns_every_escape_and_control_into_a_question_mark(text: str, shown: str) -> None:
    assert printable(text) == shown


def test_render_shows_no_control_character_of_the_state_it_is_given() -> None:
    evil = "\x1b]0;t\x07\x1b[2J\x9b1m"
    worker = {"name": evil + "w", "backend": "local", "host": evil + "h", "id": "1", "state": "busy",
              "for_seconds": 1.0, "done": 0, "in_flight": 0}
    pool = {"id": evil, "min_size": 1, "size": 1, "elastic": False, "backend": evil, "state": "RUN",
            "age_seconds": 1.0, "tasks": {"queued": 0, "running": 0, "done": 0, "failed": 0},
            "throughput": 0.0, "throughput_seconds": 10, "losses": {evil: 1}, "last_loss": evil,
            "error": evil, "calls": [{"call": evil, "units": None, "units_done": 0}], "workers": [worker]}
    state = {"run": {"id": evil, "program": evil, "pid": 1, "host": evil, "backend": evil,
                     "now": 2.0, "started": 1.0},
             "pools": [pool], "processes": [{"name": evil, "backend": None, "host": evil, "id": None,
                                             "state": evil}]}
    text = "\n".join(render(state))
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]", text), repr(text)
    assert "?w" in text and "?h" in text



def test_fiber_top_shows_the_throughput_and_a_chosen_workers_last_lines_on_a_key() -> None:
    program = Program("--losses")  # its tasks print a line each; it kills one worker
    term = Terminal(program.env)
    try:
        lines = term.screen(lambda ls: any(re.match(r"  lost    PoolWorker-\d+  stopped  ", x) for x in ls)
                            and any(re.search(r"  rate    \|.*[\u2581-\u2588].*\|  last 60 s", x) for x in ls),
                            "the loss and the throughput's sparkline")
        assert "keys: j/k (or arrows) choose a worker, l its last lines, q quits" in lines[1]
        os.write(term.master, b"j")  # the first worker ...
        lines = term.screen(lambda ls: any(x.startswith("> PoolWorker-") for x in ls), "a worker chosen")
        chosen = next(x for x in lines if x.startswith("> PoolWorker-")).split()[1]
        os.write(term.master, b"l")  # ... its last lines
        lines = term.screen(lambda ls: any(x.startswith(f"last lines of {chosen} (") for x in ls)
                            and any(re.match(r"  item \d+: done$", x) for x in ls), "its last lines")
        os.write(term.master, b"\x1b[B")  # the arrow down: the next worker, its lines
        term.screen(lambda ls: any(x.startswith("last lines of ") and chosen not in x for x in ls),
                    "the next worker's lines")
        os.write(term.master, b"q")
        assert term.proc.wait(T) == 0
    finally:
        term.close()
        program.stop()


def test_the_sparkline_has_a_character_per_second_the_busiest_full() -> None:
    assert sparkline([], 5) == " " * 5
    # 10 tasks/s 4 s ago, 5 tasks/s now, nothing between; a per-minute point is not drawn.
    line = sparkline([[300.0, 99, 60], [4.2, 10, 1], [0.4, 5, 1]], 5)
    assert line == "\u2588   \u2584"


def test_keys_move_through_the_workers_and_show_and_hide_their_lines() -> None:
    assert split_keys(b"jj\x1b[Bl\x1b") == [b"j", b"j", b"\x1b[B", b"l", b"\x1b"]
    names = ["PoolWorker-1", "PoolWorker-2"]
    c = Cursor()
    assert c.press(b"k", names) and c.selected == "PoolWorker-2"
    assert c.press(b"\x1b[B", names) and c.selected == "PoolWorker-1"  # round the end
    assert c.press(b"l", names) and c.showing
    assert c.press(b"\x1b", names) and not c.showing
    assert not c.press(b"q", names) and not Cursor().press(b"", names)
    c = Cursor()
    assert c.press(b"\r", names) and (c.selected, c.showing) == ("PoolWorker-1", True)
    assert Cursor().press(b"l", []) and Cursor().selected is None


def test_render_shows_usage_columns_cost_losses_and_the_chosen_workers_lines() -> None:
    worker = {"name": "PoolWorker-1", "backend": "local", "host": "h", "id": "1", "state": "busy",
              "for_seconds": 1.0, "done": 3, "in_flight": 1, "output": ["a", "b\x1b[2Jc"],
              "usage": {"cpu": 97.5, "rss": 3 << 30, "gpu": 40.0, "gpu_memory": 1 << 30},
              "usage_history": [[1.0, 90.0, 3 << 30]]}
    pool = {"id": "p1", "min_size": 1, "size": 1, "elastic": False, "backend": "local", "state": "RUN",
            "age_seconds": 9.0, "tasks": {"queued": 0, "running": 1, "done": 3, "failed": 0},
            "throughput": 1.0, "throughput_seconds": 10, "throughput_history": [[2.0, 3, 1]],
            "losses": {"oom": 1}, "last_loss": "PoolWorker-0 ran out of memory", "error": None,
            "calls": [], "workers": [worker], "cost_per_hour": 3.2,
            "loss_log": [{"worker": "PoolWorker-0", "reason": "oom", "ago": 5.0, "id": "0", "host": "h",
                          "description": "PoolWorker-0 ran out of memory", "output": ["x"]}]}
    state = {"run": {"id": "r", "program": "p", "pid": 1, "host": "h", "backend": "local",
                     "now": 2.0, "started": 1.0}, "pools": [pool], "processes": []}
    lines = render(state, selected="PoolWorker-1", lines_of="PoolWorker-1", keys=True)
    assert lines[2:5] == ["last lines of PoolWorker-1 (2; l hides them)", "  a", "  b?c"]
    header = next(x for x in lines if "WORKER" in x)
    assert header.split()[-3:] == ["CPU", "MEM", "GPU"]
    row = next(x for x in lines if x.startswith("> PoolWorker-1"))
    assert row.split()[-4:] == ["98%", "3.0G", "40%", "1.0G"]
    assert "  cost    $3.20 per hour" in lines
    assert "  lost    PoolWorker-0  oom  5.0 s ago: PoolWorker-0 ran out of memory" in lines
    assert render(state, lines_of="PoolWorker-9")[2] == "PoolWorker-9 is no longer a worker (j/k: another)"
