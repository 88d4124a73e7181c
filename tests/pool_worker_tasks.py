"""Tasks for tests that look inside a pool worker: this module imports nothing of the Pool."""

from __future__ import annotations

import sys


def pool_modules(_: object) -> list[str]:
    """The modules of ``fiber_core.parallel.pool`` loaded in this process."""
    return sorted(m for m in sys.modules if m.startswith("fiber_core.parallel.pool"))
