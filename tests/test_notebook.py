"""A pool in a notebook: a real IPython kernel driven by nbclient runs a map and ``display(pool)``.

The progress display is one ``display_data`` with a ``display_id`` that the pool updates
while the map runs (each update is recorded as the kernel sends it) and that shows the
final state when the cell ends; the workers' output still comes in the cell with their
``[name]`` prefixes. Outside a notebook nothing of it is loaded.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

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
