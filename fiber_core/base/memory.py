"""Giving the C allocator's free memory back to the system after a large map.

glibc keeps memory freed by a large, short-lived burst (a map's pickled batches,
its result frames, the lists of its units) in its heaps, and it adjusts its
thresholds upward after each big block, so a long-running parent that maps
millions of tasks again and again grows step by step though it holds nothing.
``malloc_trim`` returns those pages. Elsewhere (another C library) this does nothing.
"""

from __future__ import annotations

import os
import threading
from typing import Any

_trim: Any = None
_lock = threading.Lock()


def release_free_memory() -> None:
    """Return the heap's free pages to the system (glibc's ``malloc_trim(0)``); cheap next to a large map."""
    global _trim
    with _lock:
        if _trim is None:
            _trim = False
            try:
                if os.confstr("CS_GNU_LIBC_VERSION"):
                    import ctypes  # only here: a parent that never maps much never loads it

                    _trim = ctypes.CDLL(None).malloc_trim
            except (AttributeError, OSError, ValueError):
                pass
        if _trim:
            _trim(0)
