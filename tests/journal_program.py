"""A program with a journal, for tests/test_journal.py: its calls, what its tasks ran, and its results.

Each task appends ``call item`` to the file ``$RAN`` when it runs. ``$FAIL_FROM``: the items
of the first map from this one on raise (a run that stops half-way). ``$SHIFT``: added to
the first map's input (a changed program). ``$HOLD``: after the first call, wait for a line
on stdin (a master that holds the journal). ``$PAD``: characters added to each result of
``square`` (a journal that fills a disk). Prints the results as JSON.
"""

from __future__ import annotations

import json
import os
import sys

import fiber_core as mp
from fiber_core.futures import ProcessPoolExecutor


def note(x: object) -> None:
    task = mp.current_task()
    assert task is not None
    with open(os.environ["RAN"], "a") as f:
        f.write(f"{task.call} {task.item}\n")


def square(x: int) -> list[int]:
    note(x)
    if x >= int(os.environ.get("FAIL_FROM", "1000000")):
        raise ValueError(f"item {x} fails in this run")
    task = mp.current_task()
    assert task is not None
    return [x * x, task.call, task.item, task.seed, "x" * int(os.environ.get("PAD", "0"))]


def add(a: int, b: int) -> int:
    note((a, b))
    return a + b


if __name__ == "__main__":
    shift = int(os.environ.get("SHIFT", "0"))
    out: dict[str, object] = {}
    with mp.Pool(1) as pool:
        try:
            out["map"] = pool.map(square, [i + shift for i in range(8)], chunksize=1)
        except ValueError as e:
            print(f"first map failed: {e}", file=sys.stderr)
            sys.exit(3)
        if os.environ.get("HOLD"):
            print("holding", flush=True)
            sys.stdin.readline()
        out["starmap"] = pool.starmap(add, [(1, 2), (3, 4)])
        out["apply"] = pool.apply_async(add, (5, 6)).get()
        out["imap"] = list(pool.imap(square, [7, 8, 9]))
        out["imap_unordered"] = sorted(pool.imap_unordered(square, [10, 11], chunksize=2))
    with ProcessPoolExecutor(1) as ex:
        out["submit"] = ex.submit(add, 20, 22).result()
        out["executor_map"] = list(ex.map(add, [1, 2], [3, 4]))
    print(json.dumps(out))
