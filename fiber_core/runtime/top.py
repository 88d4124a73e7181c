"""``fiber top``: a running program's pools, workers and tasks in a terminal, redrawn every second.

It reads the run file of the newest live run of this user that shows its state (or of
the run it is given), dials that program's hub with the run's key from the file, and asks
for its state (:mod:`fiber_core.runtime.status`). Plain ANSI: the alternate screen, the
cursor home, each line cleared to its end; ``q`` (or Ctrl-C) quits. Without a terminal,
or with ``--once``, it prints one frame of plain text and exits.

Every text of the program's that it prints (names, hosts, loss details, a worker's error)
goes through :func:`printable` first: a name holding an escape sequence shows as ``?``
instead of retitling or clearing the operator's terminal.
"""

from __future__ import annotations

import os
import select
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from fiber_core.base.text import printable
from fiber_core.runtime.status import RunFile, Viewer, find_run

BAR_WIDTH = 40
"""Characters of the progress bar."""


def _printable_state(value: Any) -> Any:
    """``value`` (a state as the program sent it) with :func:`printable` applied to every text."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable(str(k)): _printable_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_printable_state(v) for v in value]
    return value


def duration(seconds: float) -> str:
    """``4.2 s``, ``3 min 05 s``, ``2 h 07 min``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def _columns(rows: Sequence[Sequence[str]], numeric: frozenset[int] = frozenset()) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i in numeric else c.ljust(w)
                      for i, (c, w) in enumerate(zip(row, widths))).rstrip() for row in rows]


def _bar(done: int, total: int) -> str:
    if not total:
        return "[" + " " * BAR_WIDTH + "]  no tasks yet"
    filled = BAR_WIDTH * done // total
    return f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {100 * done // total:3d}%  {done}/{total} tasks"


def render_pool(pool: dict[str, Any]) -> list[str]:
    """The lines of one pool: its size, tasks, progress, losses, calls and workers."""
    pool = _printable_state(pool)
    size = (f"{pool['min_size']}-{pool['size']} workers (elastic)" if pool["elastic"]
            else f"{pool['size']} workers")
    t = pool["tasks"]
    lines = [f"pool {pool['id']}  {size}  {pool['backend']}  {pool['state']}  "
             f"up {duration(pool['age_seconds'])}",
             f"  tasks   queued {t['queued']}  running {t['running']}  done {t['done']}  "
             f"failed {t['failed']}   {pool['throughput']:.1f} tasks/s "
             f"(last {pool['throughput_seconds']} s)",
             "  " + _bar(t["done"], t["queued"] + t["running"] + t["done"])]
    if pool["losses"]:
        lost = ", ".join(f"{reason} {n}" for reason, n in sorted(pool["losses"].items()))
        lines.append(f"  losses  {lost}" + (f"   last: {pool['last_loss']}" if pool["last_loss"] else ""))
    if pool["error"]:
        lines.append(f"  failed  {pool['error']}")
    for call in pool["calls"]:
        total = "?" if call["units"] is None else call["units"]
        lines.append(f"  call    {call['call']}  {call['units_done']}/{total} units")
    rows = [("WORKER", "BACKEND", "HOST", "ID", "STATE", "FOR", "DONE", "IN FLIGHT")]
    rows += [(w["name"], w["backend"], w["host"] or "-", w["id"] or "-", w["state"],
              duration(w["for_seconds"]), str(w["done"]), str(w["in_flight"]))
             for w in pool["workers"]]
    lines += ["  " + line for line in _columns(rows, frozenset({6, 7}))]
    return lines


def render(state: dict[str, Any]) -> list[str]:
    """The lines of one frame, for a run's state as :meth:`Viewer.ask` returns it."""
    state = _printable_state(state)
    run = state["run"]
    clock = time.strftime("%H:%M:%S", time.localtime(run["now"]))
    lines = [f"fiber top  run {run['id']}  {run['program']}  pid {run['pid']} on {run['host']}  "
             f"backend {run.get('backend') or '-'}  up {duration(run['now'] - run['started'])}  {clock}",
             ""]
    if not state["pools"]:
        lines.append("no pool")
    for pool in state["pools"]:
        lines += render_pool(pool) + [""]
    if state["processes"]:
        rows = [("PROCESS", "BACKEND", "HOST", "ID", "STATE")]
        rows += [(p["name"], p["backend"] or "-", p["host"] or "-", p["id"] or "-", p["state"])
                 for p in state["processes"]]
        lines += ["processes"] + ["  " + line for line in _columns(rows)]
    return lines


def fit(lines: list[str], width: int, height: int) -> list[str]:
    """``lines`` cut to the terminal: each to ``width``, and the last one that fits says how
    many more there are."""
    lines = [line[:width] for line in lines]
    if len(lines) > height:
        lines = lines[:height - 1] + [f"... {len(lines) - height + 1} more lines (a taller terminal shows them)"[:width]]
    return lines


class _Terminal:
    """The terminal while ``fiber top`` draws: alternate screen, no cursor, keys one by one."""

    def __init__(self, out: TextIO, keys: TextIO | None) -> None:
        self.out = out
        self.keys = keys
        self._saved: list[Any] | None = None

    def __enter__(self) -> _Terminal:
        if self.keys is not None:
            import termios  # POSIX terminals only, as the rest of the screen handling
            import tty

            try:
                self._saved = termios.tcgetattr(self.keys.fileno())
                tty.setcbreak(self.keys.fileno())
            except termios.error:
                self.keys = None
        self.out.write("\x1b[?1049h\x1b[?25l")
        self.out.flush()
        return self

    def __exit__(self, *exc: object) -> None:
        self.out.write("\x1b[?25h\x1b[?1049l")
        self.out.flush()
        if self._saved is not None and self.keys is not None:
            import termios

            termios.tcsetattr(self.keys.fileno(), termios.TCSADRAIN, self._saved)

    def size(self) -> tuple[int, int]:
        try:
            size = os.get_terminal_size(self.out.fileno())
        except (OSError, ValueError):
            size = shutil.get_terminal_size()
        return size.columns, size.lines

    def draw(self, lines: list[str]) -> None:
        width, height = self.size()
        lines = fit(lines, width, height)
        if lines:
            lines[0] = f"\x1b[1m{lines[0]}\x1b[0m"
        self.out.write("\x1b[H" + "\x1b[K\n".join(lines) + "\x1b[K\x1b[J")
        self.out.flush()

    def quit_pressed(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for a key: True for ``q``, ``Q`` or end of input."""
        if self.keys is None:
            time.sleep(timeout)  # the refresh interval itself: nothing else to wait for
            return False
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.keys], [], [], left)
            if not ready:
                return False
            key = os.read(self.keys.fileno(), 32)
            if not key or key[:1] in (b"q", b"Q"):
                return True
        return False


def top(run_id: str | None = None, interval: float = 1.0, once: bool = False,
        out: TextIO | None = None, keys: TextIO | None = None) -> int:
    """Show the run until ``q``, Ctrl-C or its end; return the exit status."""
    out = out or sys.stdout
    run: RunFile = find_run(run_id)
    with Viewer(run) as viewer:
        if once or not out.isatty():
            print("\n".join(render(viewer.ask())), file=out)
            return 0
        if keys is None and sys.stdin is not None and sys.stdin.isatty():
            keys = sys.stdin
        ended = ""
        try:
            with _Terminal(out, keys) as terminal:
                while True:
                    try:
                        state = viewer.ask()
                    except (EOFError, OSError) as e:
                        ended = printable(f"fiber top: run {run.run_id} ended ({e})")
                        break
                    terminal.draw(render(state))
                    if terminal.quit_pressed(interval):
                        break
        except KeyboardInterrupt:
            pass
        if ended:
            print(ended, file=out)
    return 0
