"""Draws the benchmark plots of the docs (PNG) from the tables of numbers recorded in the docs' pages.

The numbers live once, in the tables of ``docs/benchmarks.md`` (and the stragglers' in
``docs/guarantees.md``), where each benchmark's run put them; this script only reads them. Each plot names the table it draws by its header row, so a table renamed or
gone is an error here (and so in the docs build), not a plot that silently disappears.

    python benchmarks/plot.py [OUT_DIR]     # default docs/_generated/plots
"""

from __future__ import annotations

import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Table:
    """One Markdown table: the heading it sits under, its header cells and its rows."""

    heading: str
    header: list[str]
    rows: list[list[str]]

    def column(self, name: str) -> int:
        try:
            return self.header.index(name)
        except ValueError:
            raise LookupError(f"table {self.header} under {self.heading!r} has no column {name!r}") from None


@dataclass
class Plot:
    """A horizontal bar chart of some columns of the table whose header starts with ``first``."""

    file: str
    first: str
    series: list[str]
    title: str
    unit: str
    log: bool = False
    ratio: bool = False  # one column of fiber/multiprocessing ratios: a line at 1, bars coloured
    xlim: tuple[float, float] | None = None
    decimals: int | None = None  # for the bars' labels (default: 3 significant digits)
    labels: dict[str, str] = field(default_factory=dict)  # shorter names for the series


PLOTS = [
    Plot("core.png", "metric", ["ratio"], "Process, Pipe and Queue: fiber / multiprocessing (spawn)",
         "ratio (green: fiber better, red: worse)", log=True, ratio=True),
    Plot("local_start.png", "`Pool(n)`",
         ["fiber, template", "fiber, new interpreters", "multiprocessing fork", "multiprocessing spawn"],
         "Pool(n) until every worker runs a task (local)", "seconds (log scale)", log=True),
    Plot("overhead.png", "task", ["sleep floor (s)", "fiber (s)", "multiprocessing (s)"],
         "Pool(5): maps that should take 1 s", "seconds", xlim=(0.9, 1.25), decimals=3,
         labels={"sleep floor (s)": "sleep floor", "fiber (s)": "fiber", "multiprocessing (s)": "multiprocessing"}),
    Plot("throughput.png", "20,000 no-op tasks", ["fiber (tasks/s)", "multiprocessing (tasks/s)"],
         "Pool: no-op tasks per second", "tasks per second (log scale)", log=True,
         labels={"fiber (tasks/s)": "fiber", "multiprocessing (tasks/s)": "multiprocessing"}),
    Plot("stragglers.png", "case", ["generation (s)"],
         "An ES generation with stragglers, Pool(20)", "seconds per generation"),
    Plot("gym_vector.png", "observations", ["multiprocessing", "fiber"],
         "gymnasium AsyncVectorEnv, 8 CartPole environments", "environment steps per second"),
    Plot("managers.png", "remote step()", ["fiber (us/call)", "multiprocessing (us/call)"],
         "A remote step() on a manager-served object", "microseconds per call",
         labels={"fiber (us/call)": "fiber", "multiprocessing (us/call)": "multiprocessing"}),
    Plot("sync.png", "operation", ["multiprocessing", "fiber"],
         "Synchronization objects, attached (local backend)", "microseconds (log scale)", log=True),
    Plot("sync_served.png", "served operation (us)", ["local job, `FIBER_SYNC_SERVED=1`", "Docker job"],
         "Synchronization objects, served by their creator", "microseconds (log scale)", log=True,
         labels={"local job, `FIBER_SYNC_SERVED=1`": "local job, served", "Docker job": "Docker job"}),
    Plot("broadcast.png", "1 GiB table", ["PSS (GiB)"],
         "A 1 GiB table held by every worker: memory of the program's processes", "GiB"),
    Plot("master.png", "workers (master)", ["master thread (us/task)", "parent process (us/task)"],
         "Pool master: CPU per task, simulated workers (10 ms tasks)", "microseconds per task"),
    Plot("transport.png", "transport", ["round trip (us)"],
         "One-byte round trip to a child process", "microseconds"),
]


def tables(text: str) -> list[Table]:
    """Every table of a Markdown text, with the heading above it."""
    out: list[Table] = []
    heading = ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.startswith("|") and i + 1 < len(lines) and re.match(r"^\|[\s:|-]+\|$", lines[i + 1]):
            header = _cells(line)
            i += 2
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            out.append(Table(heading, header, rows))
            continue
        i += 1
    return out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def number(cell: str) -> float:
    """The number in a cell: ``7,755,485``, ``0.366 s``, ``1.05x``, ``12.4``."""
    m = re.fullmatch(r"\s*([0-9][0-9,]*(?:\.[0-9]+)?)\s*(?:s|ms|us|x)?\s*", cell)
    if m is None:
        raise ValueError(f"not a number: {cell!r}")
    return float(m.group(1).replace(",", ""))


def find(all_tables: list[Table], first: str) -> Table:
    found = [t for t in all_tables if t.header and t.header[0] == first]
    if len(found) != 1:
        raise LookupError(f"{len(found)} tables whose header starts with {first!r} (expected 1)")
    return found[0]


def _label(text: str) -> str:
    return "\n".join(textwrap.wrap(text.replace("`", ""), 38))


def draw(plot: Plot, table: Table, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [_label(row[0]) for row in table.rows]
    columns = [table.column(name) for name in plot.series]
    values = [[number(row[c]) for row in table.rows] for c in columns]
    n, k = len(labels), len(columns)
    height = 0.8 / k
    fig, ax = plt.subplots(figsize=(8, 0.45 * n * max(1, k * 0.6) + 1.4))
    for j, (name, vals) in enumerate(zip(plot.series, values, strict=True)):
        ys = [i + (j - (k - 1) / 2) * height for i in range(n)]
        if plot.ratio:
            colors = [_ratio_color(row[0], v) for row, v in zip(table.rows, vals, strict=True)]
            bars = ax.barh(ys, vals, height, color=colors)
            ax.axvline(1.0, color="black", linewidth=0.8)
        else:
            bars = ax.barh(ys, vals, height, label=plot.labels.get(name, name.replace("`", "")))
        ax.bar_label(bars, labels=[_short(v, plot.decimals) for v in vals], padding=3, fontsize=8)
    ax.set_yticks(range(n), labels, fontsize=8)
    ax.invert_yaxis()
    if plot.log:
        ax.set_xscale("log")
    if plot.xlim:
        ax.set_xlim(*plot.xlim)
    ax.margins(x=0.15)
    ax.set_xlabel(plot.unit)
    ax.set_title(plot.title, fontsize=10)
    if k > 1:
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / plot.file
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path


def _ratio_color(metric: str, ratio: float) -> str:
    lower_is_better = "lower is better" in metric
    better = ratio < 1 if lower_is_better else ratio > 1
    return "tab:green" if better else "tab:red"


def _short(v: float, decimals: int | None = None) -> str:
    if decimals is not None:
        return f"{v:.{decimals}f}"
    if v >= 10_000:
        return f"{v:,.0f}"
    return f"{v:.3g}" if v < 100 else f"{v:.0f}"


PAGES = [ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "guarantees.md"]


def draw_all(out: Path, pages: list[Path] = PAGES) -> list[Path]:
    """Draw every plot of :data:`PLOTS` from the tables of ``pages`` into ``out``."""
    all_tables = [t for page in pages for t in tables(page.read_text(encoding="utf-8"))]
    return [draw(plot, find(all_tables, plot.first), out) for plot in PLOTS]


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else ROOT / "docs" / "_generated" / "plots"
    for path in draw_all(out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
