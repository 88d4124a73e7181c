"""``fiber top``: a running program's pools, workers and tasks in a terminal, redrawn every second.

It reads the run file of the newest live run of this user that shows its state (or of
the run it is given), dials that program's hub with the run's key from the file, and asks
for its state (:mod:`fiber_core.runtime.status`). Plain ANSI: the alternate screen, the
cursor home, each line cleared to its end; ``j``/``k`` (or the arrows) choose a worker,
``l`` (or Enter) shows its last lines, ``q`` (or Ctrl-C) quits. Without a terminal,
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


SPARK_SECONDS = 60
"""The throughput sparkline's span: one character per second."""

_SPARKS = " \u2581\u2582\u2583\u2584\u2585\u2586\u2587\u2588"  # nothing, then 1/8 to 8/8 of a cell

LOSSES_SHOWN = 3
"""Losses listed under a pool, the last ones (the page lists more)."""


def sparkline(history: list[list[float]], seconds: int = SPARK_SECONDS) -> str:
    """Tasks per second over the last ``seconds`` (a pool's ``throughput_history``), a
    character a second, the oldest first; the tallest is the busiest second."""
    per_second = [0.0] * seconds
    for ago, rate, span in history:
        if span == 1 and 0 <= ago < seconds:  # (ago 0.3: this second, the last cell)
            per_second[seconds - 1 - int(ago)] += rate
    top = max(per_second)
    if top <= 0:
        return " " * seconds
    return "".join(_SPARKS[0 if r <= 0 else max(1, round(8 * r / top))] for r in per_second)


def size(n: float) -> str:
    """``512B``, ``3.2K``, ``1.5G``: bytes as ``top`` shows them."""
    for unit in ("B", "K", "M", "G"):
        if n < 1024:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}T"


def _usage_columns(w: dict[str, Any], gpu: bool) -> tuple[str, ...]:
    u = w.get("usage")
    if not u:
        return ("-", "-") + (("-",) if gpu else ())
    cells: tuple[str, ...] = (f"{u['cpu']:.0f}%", size(u["rss"]))
    if gpu:
        cells += ("-" if u.get("gpu") is None else f"{u['gpu']:.0f}%"
                  + ("" if u.get("gpu_memory") is None else f" {size(u['gpu_memory'])}"),)
    return cells


def _workers_table(workers: list[dict[str, Any]], selected: str | None) -> list[str]:
    usage = any(w.get("usage") for w in workers)
    gpu = any((w.get("usage") or {}).get("gpu") is not None for w in workers)
    head: tuple[str, ...] = ("WORKER", "BACKEND", "HOST", "ID", "STATE", "FOR", "DONE", "IN FLIGHT")
    head += (("CPU", "MEM") if usage else ()) + (("GPU",) if gpu else ())
    rows = [head]
    for w in workers:
        row: tuple[str, ...] = (w["name"], w["backend"], w["host"] or "-", w["id"] or "-", w["state"],
                                duration(w["for_seconds"]), str(w["done"]), str(w["in_flight"]))
        rows.append(row + (_usage_columns(w, gpu) if usage else ()))
    marks = ["  "] + ["> " if w["name"] == selected else "  " for w in workers]
    return [mark + line for mark, line in zip(marks, _columns(rows, frozenset({6, 7, 8, 9})))]


def render_pool(pool: dict[str, Any], selected: str | None = None) -> list[str]:
    """The lines of one pool: its size, tasks, progress, throughput over the last minute,
    losses, calls and workers (``selected``: the worker marked ``>``)."""
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
    if "throughput_history" in pool:
        lines.append(f"  rate    |{sparkline(pool['throughput_history'])}|  last {SPARK_SECONDS} s")
    if pool["losses"]:
        lost = ", ".join(f"{reason} {n}" for reason, n in sorted(pool["losses"].items()))
        lines.append(f"  losses  {lost}" + (f"   last: {pool['last_loss']}" if pool["last_loss"] else ""))
    for loss in pool.get("loss_log", [])[:LOSSES_SHOWN]:
        lines.append(f"  lost    {loss['worker']}  {loss['reason']}  {duration(loss['ago'])} ago: "
                     f"{loss['description']}")
    if pool["error"]:
        lines.append(f"  failed  {pool['error']}")
    for call in pool["calls"]:
        total = "?" if call["units"] is None else call["units"]
        lines.append(f"  call    {call['call']}  {call['units_done']}/{total} units")
    if isinstance(pool.get("cost_per_hour"), (int, float)):
        lines.append(f"  cost    {pool.get('cost_currency') or '$'}{pool['cost_per_hour']:.2f} per hour")
    lines += _workers_table(pool["workers"], selected)
    return lines


def worker_names(state: dict[str, Any]) -> list[str]:
    """The live workers of every pool, in the order a frame shows them (what ``j``/``k`` move through)."""
    return [printable(w["name"]) for pool in state["pools"] for w in pool["workers"]]


def _last_lines(state: dict[str, Any], name: str) -> list[str]:
    for pool in state["pools"]:
        for w in pool["workers"]:
            if w["name"] == name:
                lines = w.get("output") or []
                return [f"last lines of {name} ({len(lines)}; l hides them)"] + [f"  {x}" for x in lines]
    return [f"{name} is no longer a worker (j/k: another)"]


def render(state: dict[str, Any], selected: str | None = None, lines_of: str | None = None,
           keys: bool = False) -> list[str]:
    """The lines of one frame, for a run's state as :meth:`Viewer.ask` returns it:
    ``selected``, the worker marked ``>``; ``lines_of``, the worker whose last lines are
    shown (under the header, so that they stay on screen); ``keys``, a line of help."""
    state = _printable_state(state)
    run = state["run"]
    clock = time.strftime("%H:%M:%S", time.localtime(run["now"]))
    lines = [f"fiber top  run {run['id']}  {run['program']}  pid {run['pid']} on {run['host']}  "
             f"backend {run.get('backend') or '-'}  up {duration(run['now'] - run['started'])}  {clock}",
             "keys: j/k (or arrows) choose a worker, l its last lines, q quits" if keys else ""]
    if lines_of is not None:
        lines += _last_lines(state, lines_of) + [""]
    if not state["pools"]:
        lines.append("no pool")
    for pool in state["pools"]:
        lines += render_pool(pool, selected) + [""]
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

    def keys_pressed(self, timeout: float) -> list[bytes] | None:
        """Wait up to ``timeout`` for keys: what came (:func:`split_keys`; ``[b""]`` at the
        end of input), or ``None`` when none came in time."""
        if timeout <= 0:
            return None
        if self.keys is None:
            time.sleep(timeout)  # the refresh interval itself: nothing else to wait for
            return None
        ready, _, _ = select.select([self.keys], [], [], timeout)
        if not ready:
            return None
        return split_keys(os.read(self.keys.fileno(), 64)) or [b""]


_MOVES = {b"j": 1, b"\x1b[B": 1, b"\x1bOB": 1, b"k": -1, b"\x1b[A": -1, b"\x1bOA": -1}


def split_keys(data: bytes) -> list[bytes]:
    """One read of the terminal as keys: an arrow's escape sequence is one key."""
    keys = []
    i = 0
    while i < len(data):
        n = 3 if data[i:i + 1] == b"\x1b" and data[i + 1:i + 2] in (b"[", b"O") and i + 2 < len(data) else 1
        keys.append(data[i:i + n])
        i += n
    return keys


class Cursor:
    """What the keys chose: a worker (``j``/``k`` or the arrows), whether its last lines
    show (``l`` or Enter; Escape hides them)."""

    def __init__(self) -> None:
        self.selected: str | None = None
        self.showing = False

    def press(self, key: bytes, names: list[str]) -> bool:
        """Act on ``key``, ``names`` being the workers shown; False: quit (``q``, end of input)."""
        if not key or key in (b"q", b"Q"):
            return False
        if key in _MOVES:
            self._move(_MOVES[key], names)
        elif key in (b"l", b"L", b"\r", b"\n"):
            if self.selected is None:
                self._move(1, names)
            self.showing = self.selected is not None and not self.showing
        elif key == b"\x1b":
            self.showing = False
        return True

    def _move(self, step: int, names: list[str]) -> None:
        if not names:
            return
        if self.selected in names:
            self.selected = names[(names.index(self.selected) + step) % len(names)]
        else:
            self.selected = names[0 if step > 0 else -1]


def _show(viewer: Viewer, terminal: _Terminal, interval: float, run: RunFile) -> str:
    """Draw the run until ``q`` or its end; return what to say once the screen is given back."""
    cursor = Cursor()
    asked_at = -interval
    state: dict[str, Any] = {}
    while True:
        if time.monotonic() - asked_at >= interval:
            try:
                state = viewer.ask()
            except (EOFError, OSError) as e:
                return printable(f"fiber top: run {run.run_id} ended ({e})")
            asked_at = time.monotonic()
        terminal.draw(render(state, cursor.selected, cursor.selected if cursor.showing else None,
                             keys=terminal.keys is not None))
        keys = terminal.keys_pressed(asked_at + interval - time.monotonic())
        names = worker_names(state)
        if keys is not None and not all(cursor.press(key, names) for key in keys):
            return ""


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
                ended = _show(viewer, terminal, interval, run)
        except KeyboardInterrupt:
            pass
        if ended:
            print(ended, file=out)
    return 0
