"""The scorecard benchmark runs for Fiber alone at a tiny size (the peers' runs are not a test)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "scorecard.py")


def test_the_scorecard_prints_fibers_row_exact_under_a_seeded_kill_schedule() -> None:
    out = subprocess.run(
        [sys.executable, SCRIPT, "--libraries", "fiber", "--kinds", "none,kill", "--tasks", "200",
         "--generations", "2", "--population", "100", "--workers", "2", "--faults", "2", "--seed", "7",
         "--stall", "60"],
        capture_output=True, text=True, timeout=180, env={**os.environ, "FIBER_CHAOS_SEED": ""})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FIBER_CHAOS_SEED=7" in out.stderr
    assert "kill: seed 8: after " in out.stdout, out.stdout
    struck = re.search(r'^fiber kill: .*"struck": \[\[(\d+), "kill", \d+\]', out.stdout, re.M)
    assert struck, out.stdout  # the schedule struck a worker of the pool
    row = re.search(r"^\| fiber \| (.*) \| (.*) \|$", out.stdout, re.M)
    assert row, out.stdout
    assert row.group(1).startswith("exact, 1.00x"), row.group(0)
    assert row.group(2).startswith("exact, "), row.group(0)
