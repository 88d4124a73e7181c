"""A pool in a notebook: a real IPython kernel driven by nbclient runs a map and ``display(pool)``.

The progress display is one ``display_data`` with a ``display_id`` that the pool updates
while the map runs (each update is recorded as the kernel sends it) and that shows the
final state when the cell ends; the workers' output still comes in the cell with their
``[name]`` prefixes. Outside a notebook nothing of it is loaded.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fiber_core.parallel.durable import records

nbformat = pytest.importorskip("nbformat", reason="nbformat (requirements-test.txt) writes the notebook")
nbclient = pytest.importorskip("nbclient", reason="nbclient (requirements-test.txt) runs the notebook")
pytest.importorskip("ipykernel", reason="ipykernel (requirements-test.txt) is the notebook's kernel")

T = 120  # bound of each cell: reaching it is a failure, never a measure of speed
N = 400

pytestmark = pytest.mark.timeout(300)

CELLS = [
    """\
import time
import fiber_core

def work(x):
    time.sleep(0.01)  # the work itself
    if x % 100 == 0:
        print("reached", x, flush=True)
    return x * x

pool = fiber_core.Pool(2)""",
    f"sum(pool.map(work, range({N}), chunksize=1))",
    "display(pool)",
    "pool.close()\npool.join()",
    """\
from fiber_core.futures import ProcessPoolExecutor
with ProcessPoolExecutor(2) as executor:
    total = sum(executor.map(work, range(100)))
total""",
]


class Recording(nbclient.NotebookClient):
    """A notebook client that keeps every message of the kernel's output channel it handles."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.messages: list[tuple[int, dict[str, Any]]] = []

    def process_message(self, msg: dict[str, Any], cell: Any, cell_index: int) -> Any:
        self.messages.append((cell_index, msg))
        return super().process_message(msg, cell, cell_index)


def _attrs(html: str, cls: str) -> dict[str, str]:
    found = re.search(rf'<div class="{cls}"([^>]*)>', html)
    assert found, html
    return dict(re.findall(r'data-([a-z]+)="([^"]*)"', found.group(1)))


def test_a_map_in_a_notebook_shows_its_progress_updating_then_done_and_the_pool_displays_itself(
        tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    client = Recording(nb, timeout=T, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}})
    client.execute()

    # The map's cell: one progress display, done, and the workers' lines with their names.
    outputs = nb.cells[1].outputs
    [shown] = [o for o in outputs if o.output_type == "display_data"]
    final = _attrs(shown.data["text/html"], "fiber-progress")
    assert (final["state"], final["done"], final["total"]) == ("done", str(N), str(N))
    assert f"{N} of {N} tasks (100%)" in shown.data["text/html"]
    [result] = [o for o in outputs if o.output_type == "execute_result"]
    assert result.data["text/plain"] == str(sum(x * x for x in range(N)))
    printed = "".join(o.text for o in outputs if o.output_type == "stream")
    assert re.search(r"^\[PoolWorker-\d+\] reached 100$", printed, re.M), printed

    # It was updated while the map ran: some update shows it part done.
    display_id = shown.transient["display_id"] if "transient" in shown else None
    updates = [_attrs(m["content"]["data"]["text/html"], "fiber-progress") for i, m in client.messages
               if i == 1 and m["msg_type"] == "update_display_data"
               and (display_id is None or m["content"]["transient"]["display_id"] == display_id)]
    done = [int(u["done"]) for u in updates]
    assert any(0 < d < N for d in done), done
    assert done == sorted(done) and done[-1] == N

    # display(pool): the pool's summary, its workers by name ...
    [first] = [m["content"]["data"]["text/html"] for i, m in client.messages
               if i == 2 and m["msg_type"] == "display_data"]
    assert _attrs(first, "fiber-pool")["done"] == str(N) and _attrs(first, "fiber-pool")["state"] == "RUN"
    assert "Fiber pool" in first and len(re.findall(r"<td[^>]*>PoolWorker-\d+</td>", first)) == 2
    # ... kept up to date: once the pool is closed and joined, it says so.
    [summary] = [o for o in nb.cells[2].outputs if o.output_type == "display_data"]
    assert _attrs(summary.data["text/html"], "fiber-pool")["state"] == "CLOSE"

    # An executor's calls: one display for the cell, all of its tasks done.
    [shown] = [o for o in nb.cells[4].outputs if o.output_type == "display_data"]
    final = _attrs(shown.data["text/html"], "fiber-progress")
    assert (final["state"], final["done"], final["total"]) == ("done", "100", "100")


def test_outside_a_notebook_a_pool_loads_nothing_of_ipython() -> None:
    code = ("import sys, fiber_core\n"
            "with fiber_core.Pool(1) as pool:\n"
            "    assert pool.map(abs, [-1, -2]) == [1, 2]\n"
            "    assert '<div class=\"fiber-pool\"' in pool._repr_html_()\n"
            "print('IPython' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=T)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_what_a_notebook_shows_is_escaped_and_counts_only_the_cells_tasks() -> None:
    from fiber_core.parallel.pool.notebook import pool_html, progress_html

    evil = "<img src=x onerror=alert(1)>"
    worker = {"name": evil, "host": evil, "state": "busy", "done": 5, "output": [evil]}
    snap = {"id": "p1", "size": 1, "backend": "local", "state": "RUN", "throughput": 2.0,
            "tasks": {"queued": 10, "running": 1, "done": 25, "failed": 0}, "losses": {evil: 2},
            "last_loss": evil, "calls": [{"call": evil, "units": 16, "units_done": 5}], "workers": [worker]}
    html = progress_html(snap, base_done=20, base_losses=1, seconds=1.0)
    assert _attrs(html, "fiber-progress") == {"pool": "p1", "done": "5", "total": "16", "state": "running"}
    assert "5 of 16 tasks (31%)" in html and "1 workers lost" in html
    summary = pool_html(snap)
    for shown in (html, summary):
        assert "<img" not in shown and "&lt;img src=x onerror=alert(1)&gt;" in shown


# -- a journalled map in a notebook whose kernel restarts ---------------------------------------


class Kernel:
    """One notebook's kernel, driven cell by cell; it can be restarted like Jupyter's button does."""

    def __init__(self, client: nbclient.NotebookClient) -> None:
        self.client = client
        self.nb = client.nb

    def run(self, code: str, raises: bool = False) -> tuple[str, Any]:
        """Run ``code`` as a new cell: what it printed to stderr (and its error), and its
        result (the value its ``text/plain`` shows; None without one)."""
        cell = nbformat.v4.new_code_cell(code, metadata={"tags": ["raises-exception"] if raises else []})
        self.nb.cells.append(cell)
        self.client.execute_cell(cell, len(self.nb.cells) - 1)
        errors = "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stderr")
        errors += "".join(f"{o.ename}: {o.evalue}" for o in cell.outputs if o.output_type == "error")
        results = [o.data["text/plain"] for o in cell.outputs if o.output_type == "execute_result"]
        return errors, ast.literal_eval(results[0]) if results else None

    def restart(self) -> None:
        nbclient.util.run_sync(self.client.km.restart_kernel)()
        nbclient.util.run_sync(self.client.kc.wait_for_ready)(timeout=T)


@contextlib.contextmanager
def kernel(tmp_path: Path, **env: str) -> Iterator[Kernel]:
    """A kernel started in ``tmp_path`` with ``env`` added to its environment."""
    client = nbclient.NotebookClient(nbformat.v4.new_notebook(), timeout=T, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    with client.setup_kernel(env={**os.environ, **env}):
        yield Kernel(client)


def _setup(journal: Path, ran: Path) -> str:
    """The notebook's first cell: a journal, a function that counts its runs, a pool."""
    return f"""\
import fiber_core
fiber_core.init(journal={str(journal)!r})

def f(x):
    with open({str(ran)!r}, "a") as out:
        out.write(f"{{x}}\\n")
    return x * x

pool = fiber_core.Pool(2)"""


def _runs(ran: Path) -> list[int]:
    return sorted(int(x) for x in ran.read_text().split()) if ran.exists() else []


def test_a_restarted_kernel_that_runs_the_cells_again_gets_the_recorded_results_and_runs_no_task(
        tmp_path: Path) -> None:
    journal, ran, notebook = tmp_path / "journal", tmp_path / "ran", tmp_path / "durable.ipynb"
    expected = [x * x for x in range(20)]
    with kernel(tmp_path, JPY_SESSION_NAME=str(notebook)) as nb:  # as Jupyter's server starts it
        assert nb.run(_setup(journal, ran)) == ("", None)
        assert nb.run("pool.map(f, range(20))") == ("", expected)
        assert _runs(ran) == list(range(20))

        nb.restart()
        assert nb.run(_setup(journal, ran)) == ("", None)
        assert nb.run("pool.map(f, range(20))") == ("", expected)
        assert _runs(ran) == list(range(20))  # no task ran again

        nb.restart()  # and now the cell's input changes: the replay ends there, with one warning
        nb.run(_setup(journal, ran))
        errors, result = nb.run("pool.map(f, range(1, 21))")
        assert result == [x * x for x in range(1, 21)]
        assert errors == ("fiber: the journal's replay ends at call 0, map(f): its arguments differ from "
                          "the recorded ones; it and the calls after it run again\n")
        assert _runs(ran) == sorted([*range(20), *range(1, 21)])
    scan = records.scan((journal / "journal").read_bytes())
    assert records.read_header(scan.records[0][1])["program"] == str(notebook)


def test_a_kernel_that_does_not_know_its_notebook_is_refused_a_journal_until_the_program_is_named(
        tmp_path: Path) -> None:
    journal, ran = tmp_path / "journal", tmp_path / "ran"
    with kernel(tmp_path) as nb:
        nb.run(_setup(journal, ran))
        errors, _ = nb.run("pool.map(f, range(5))", raises=True)
        assert errors.startswith("JournalError: a journal needs to know which program it belongs to")
        assert 'fiber_core.init(journal=..., program="my-analysis")' in errors and not ran.exists()
        nb.run('fiber_core.init(program="squares")')
        assert nb.run("pool.map(f, range(5))") == ("", [0, 1, 4, 9, 16])

        nb.restart()
        nb.run(_setup(journal, ran) + '\nfiber_core.init(program="squares")')
        assert nb.run("pool.map(f, range(5))") == ("", [0, 1, 4, 9, 16])
        assert _runs(ran) == list(range(5))
