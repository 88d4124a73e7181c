"""CPython's own multiprocessing suite, processes flavour, against Fiber on the local backend.

Two promises: no test hangs (each class runs in its own interpreter under a hang
limit, so a hang is counted, never waited out), and no fewer tests pass than when
the floor below was set. docs/compatibility.md has the method, the numbers and the
failing tests by cause. Select with ``-m compat``, leave out with ``-m "not compat"``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import cpython_suite
import pytest

from fiber_core.testing import service_missing

pytestmark = pytest.mark.compat

PASSING_FLOOR = {(3, 11): 131}
"""Processes-flavour tests that pass on the local backend, per Python (of 144 on 3.11).

The count measured when the floor was last set: raise it when a feature lands.
"""

KNOWN_HANGS: set[str] = set()
"""Tests that hang today (killed at the hang limit). Remove one when it is fixed."""


@pytest.mark.timeout(1800)  # a bound for the whole run; each test is bounded by hang_after
def test_processes_flavour_on_local_backend(tmp_path: Path) -> None:
    try:
        cpython_suite.suite_test_dir()
    except RuntimeError as e:
        service_missing(str(e))
    run = cpython_suite.run_suite("fiber", ("processes",), backend="local", work=tmp_path,
                                  hang_after=60.0, progress=sys.stderr)
    summary = cpython_suite.summary_line(run, "processes")
    print(summary)
    results = run.results("processes")
    assert results, "no test of the processes flavour ran"

    hung = {r.test: r.detail for r in results if r.status == "hung"}
    new_hangs = sorted(set(hung) - KNOWN_HANGS)
    assert not new_hangs, f"tests hung: {new_hangs} ({summary}; logs under {tmp_path})"
    exit_hangs = [c.name for c in run.classes if c.hung and not any(
        r.status == "hung" for r in c.results)]
    assert not exit_hangs, f"classes hung outside their tests: {exit_hangs} (logs under {tmp_path})"

    floor = PASSING_FLOOR.get(sys.version_info[:2])
    if floor is None:
        pytest.skip(f"no floor set for Python {sys.version_info[0]}.{sys.version_info[1]}: {summary}")
    passed = run.counts("processes")["passed"]
    failing = sorted(f"{r.test}: {r.status}: {r.detail}" for r in results if r.status != "passed")
    assert passed >= floor, (
        f"{passed} tests passed, fewer than the floor of {floor} ({summary}); not passing:\n"
        + "\n".join(failing))
