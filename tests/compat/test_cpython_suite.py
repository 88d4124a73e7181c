"""CPython's own multiprocessing suite, processes flavour, against Fiber on the local backend.

Two promises: no test hangs (each class runs in its own interpreter under a hang
limit, so a hang is counted, never waited out), and no fewer tests pass than when
the floor below was set. docs/compatibility.md has the method, the numbers and the
failing tests by cause. Select with ``-m compat``, leave out with ``-m "not compat"``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import cpython_suite
import pytest

from fiber_core.testing import service_missing

pytestmark = pytest.mark.compat

PASSING_FLOOR = {("local", (3, 11)): 131, ("docker", (3, 11)): 123}
"""Processes-flavour tests that pass, per backend and Python (of 144 on 3.11).

The count measured when the floor was last set: raise it when a feature lands. On
Docker one below the count measured (124): ``test_many_processes`` starts 100
containers and, on a loaded machine, can miss the suite's own 30 s bound for joining
them.
"""

KNOWN_HANGS: dict[str, set[str]] = {"local": set(), "docker": set()}
"""Tests that hang today (killed at the hang limit), per backend. Remove one when it is fixed."""


def _run_and_check(backend: str, work: Path, hang_after: float,
                   env: dict[str, str] | None = None) -> None:
    try:
        cpython_suite.suite_test_dir()
    except RuntimeError as e:
        service_missing(str(e))
    base = None if env is None else {**os.environ, **env}
    run = cpython_suite.run_suite("fiber", ("processes",), backend=backend, work=work,
                                  hang_after=hang_after, progress=sys.stderr, base_env=base)
    summary = cpython_suite.summary_line(run, "processes")
    print(summary)
    results = run.results("processes")
    assert results, "no test of the processes flavour ran"

    hung = {r.test: r.detail for r in results if r.status == "hung"}
    new_hangs = sorted(set(hung) - KNOWN_HANGS[backend])
    assert not new_hangs, f"tests hung: {new_hangs} ({summary}; logs under {work})"
    exit_hangs = [c.name for c in run.classes if c.hung and not any(
        r.status == "hung" for r in c.results)]
    assert not exit_hangs, f"classes hung outside their tests: {exit_hangs} (logs under {work})"

    floor = PASSING_FLOOR.get((backend, sys.version_info[:2]))
    if floor is None:
        pytest.skip(f"no floor set for Python {sys.version_info[0]}.{sys.version_info[1]}: {summary}")
    passed = run.counts("processes")["passed"]
    failing = sorted(f"{r.test}: {r.status}: {r.detail}" for r in results if r.status != "passed")
    assert passed >= floor, (
        f"{passed} tests passed, fewer than the floor of {floor} ({summary}); not passing:\n"
        + "\n".join(failing))


@pytest.mark.timeout(1800)  # a bound for the whole run; each test is bounded by hang_after
def test_processes_flavour_on_local_backend(tmp_path: Path) -> None:
    _run_and_check("local", tmp_path, hang_after=60.0)


@pytest.mark.timeout(1800)
def test_processes_flavour_on_docker(tmp_path: Path) -> None:
    """Every process of the suite a container of the test daemon, sharing this machine's IPC.

    ``ipc_mode=host`` as a user sharing memory with containers on one machine sets it:
    the suite's Barrier and Condition helpers keep their state in a raw shared buffer,
    which a container with its own ``/dev/shm`` cannot map (Fiber serves elements, not
    buffers), and their polling loops would wait for it forever. Everything else, the
    start of each job, its connection and the served Pipes, Queues and Pools, is as on
    any remote host.
    """
    try:
        cpython_suite.docker_service_env()
    except RuntimeError as e:
        service_missing(str(e))
    _run_and_check("docker", tmp_path, hang_after=90.0, env={"FIBER_DOCKER_IPC_MODE": "host"})
