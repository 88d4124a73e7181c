"""The scorecard benchmark runs for Fiber alone at a tiny size (the peers' runs are not a test);
its choice of what each fault kind applies to is a pure function, tested here."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
SCRIPT = os.path.join(BENCHMARKS, "scorecard.py")
sys.path.insert(0, BENCHMARKS)

from scorecard import hung_why  # noqa: E402
from scoring.backends import is_worker  # noqa: E402
from scoring.kinds import BACKENDS, KINDS, fault_count, not_applicable  # noqa: E402


def test_the_scorecard_prints_fibers_row_exact_under_a_seeded_kill_schedule() -> None:
    out = subprocess.run(
        [sys.executable, SCRIPT, "--libraries", "fiber", "--kinds", "none,kill", "--tasks", "200",
         "--generations", "2", "--population", "100", "--workers", "2", "--faults", "2", "--seed", "7",
         "--stall", "60"],
        capture_output=True, text=True, timeout=180, env={**os.environ, "FIBER_CHAOS_SEED": ""})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FIBER_CHAOS_SEED=7" in out.stderr
    assert "kill: seed 8: after " in out.stdout, out.stdout
    struck = re.search(r'^fiber local kill: .*"struck": \[\[(\d+), "kill", \d+\]', out.stdout, re.M)
    assert struck, out.stdout  # the schedule struck a worker of the pool
    row = re.search(r"^\| fiber local \| (.*) \| (.*) \|$", out.stdout, re.M)
    assert row, out.stdout
    assert row.group(1).startswith("exact, 1.00x"), row.group(0)
    assert row.group(2).startswith("exact, "), row.group(0)


def test_a_fault_that_cannot_be_produced_is_not_run_and_its_footnote_says_why() -> None:
    out = subprocess.run(
        [sys.executable, SCRIPT, "--libraries", "fiber", "--kinds", "heal,restart", "--tasks", "20"],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "| fiber local | n/a [1] | n/a [2] |" in out.stdout, out.stdout
    assert re.search(r"^\[1\] n/a: the local backend's workers talk .* Unix sockets", out.stdout, re.M), out.stdout
    assert re.search(r"^\[2\] n/a: no platform API", out.stdout, re.M), out.stdout
    assert "fiber local heal:" not in out.stdout  # no cell ran


def test_an_unknown_backend_is_refused_at_once_with_the_known_ones() -> None:
    out = subprocess.run([sys.executable, SCRIPT, "--backends", "local,k8s"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "unknown backend 'k8s'" in out.stderr and "kubernetes" in out.stderr, out.stderr


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_applies_to_fiber_on_some_backend_here(kind: str) -> None:
    assert any(not_applicable("fiber", backend, kind) is None for backend in BACKENDS)


def test_network_faults_apply_to_the_ssh_hosts_only_and_api_restarts_to_platforms_with_an_api() -> None:
    where = {kind: [b for b in BACKENDS if not_applicable("fiber", b, kind) is None] for kind in KINDS}
    assert where["heal"] == where["cut"] == where["loss"] == ["ssh"]
    assert where["restart"] == ["docker", "kubernetes"]
    assert where["kill"] == where["term"] == where["stop"] == list(BACKENDS)


def test_the_peers_are_struck_by_signals_only() -> None:
    assert [k for k in KINDS if not_applicable("dask", None, k) is None] == ["none", "kill", "term", "stop"]


def test_a_partition_for_good_and_a_loss_strike_once_and_the_undisturbed_run_not_at_all() -> None:
    assert [fault_count(k, 3) for k in KINDS] == [0, 3, 3, 3, 3, 1, 1, 3]


def test_a_cell_is_hung_by_its_stall_once_started_and_by_the_start_bound_before() -> None:
    bounds = {"stall": 40.0, "start": 300.0, "limit": 1000.0}
    assert hung_why(100.0, None, **bounds) is None  # a slow start is not a stall
    assert hung_why(301.0, None, **bounds) == "not started within 300 s"
    assert hung_why(301.0, 39.0, **bounds) is None
    assert hung_why(301.0, 41.0, **bounds) == "no result for 40 s"
    assert hung_why(1001.0, 1.0, **bounds) == "past 1000 s"


def test_a_workers_process_is_told_from_the_init_and_the_shell_that_start_it() -> None:
    worker = [b"python3", b"-m", b"fiber_core.processes.worker", b""]
    assert is_worker(worker)
    assert not is_worker([b"/sbin/docker-init", b"--", b"/bin/sh", b"-c", b"exec \"$@\"", b"fiber-job", *worker])
    assert not is_worker([b"/bin/sh", b"-c", b"\"$@\" & p=$!", b"fiber-job", *worker])
