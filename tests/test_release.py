"""Pools and Processes give back their descriptors when closed and joined, without the cyclic GC."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed

_LOOP = """
import gc, os, sys, time, warnings
import fiber_core

def nothing():
    pass

def descriptors():
    return len(os.listdir("/proc/self/fd"))

if __name__ == "__main__":
    what, n = sys.argv[1], int(sys.argv[2])
    warnings.simplefilter("always", ResourceWarning)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.disable()
        gc.collect()
        if what == "pool":
            pool = fiber_core.Pool(1)  # the run's own descriptors (hub, listeners) now exist
            pool.close()
            pool.join()
            del pool
            before = descriptors()
            for _ in range(n):
                pool = fiber_core.Pool(1)
                pool.close()
                pool.join()
                del pool
        else:
            p = fiber_core.Process(target=nothing)
            p.start()
            p.join()
            del p
            before = descriptors()
            for _ in range(n // 10):  # ten at a time
                ps = [fiber_core.Process(target=nothing) for _ in range(10)]
                for p in ps:
                    p.start()
                for p in ps:
                    p.join()
                    assert p.exitcode == 0
                del ps, p
        deadline = time.monotonic() + 10  # the last ones' threads may still be closing theirs
        while descriptors() > before and time.monotonic() < deadline:
            time.sleep(0.01)
        after = descriptors()
        gc.enable()
        gc.collect()
    resource_warnings = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    print(before, after, resource_warnings)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("what, n", [("pool", 200), ("process", 500)])
def test_closed_and_joined_leave_descriptors_flat_without_gc(what: str, n: int, tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(_LOOP)
    r = subprocess.run([sys.executable, str(script), what, str(n)], capture_output=True, text=True,
                       cwd=tmp_path, timeout=8 * T)
    assert r.returncode == 0, r.stderr[-3000:]
    before, after, warnings = r.stdout.split(" ", 2)
    assert int(after) <= int(before), f"{what}: {before} descriptors before {n} of them, {after} after"
    assert warnings.strip() == "[]"
