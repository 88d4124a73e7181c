"""Functions the conformance suite runs inside jobs.

Kept apart from the suite so that a job imports them without pytest, which
job images (containers, pods, Batch jobs) usually lack.
"""

from __future__ import annotations

from typing import Any


def put_square(q: Any, x: int) -> None:
    q.put(x * x)
