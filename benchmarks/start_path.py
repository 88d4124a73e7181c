"""How far a Process.start() travels: module crossings from the call to the backend's create_job.

Traces every Python call made by ``Process.start()`` on the local backend, up to the
moment the backend's ``create_job`` is entered, and counts the calls that cross from
one ``fiber_core`` module into another, and how many times each module is entered.
The first start of a process pays for selecting the backend; later ones should not.

    python benchmarks/start_path.py
"""

from __future__ import annotations

import collections
import sys
from types import FrameType
from typing import Any

import fiber_core


def _noop() -> None:
    pass


def trace_start() -> tuple[int, collections.Counter[str]]:
    crossings = 0
    entered: collections.Counter[str] = collections.Counter()
    stack: list[str] = []
    done = False

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal crossings, done
        if done:
            return
        module = frame.f_globals.get("__name__", "")
        if event == "call":
            caller = stack[-1] if stack else ""
            stack.append(module)
            if module.startswith("fiber_core") and caller.startswith("fiber_core") and module != caller:
                crossings += 1
                entered[module] += 1
            if frame.f_code.co_name == "create_job":
                done = True
        elif event == "return" and stack:
            stack.pop()

    p = fiber_core.Process(target=_noop)
    sys.setprofile(profile)
    try:
        p.start()
    finally:
        sys.setprofile(None)
    p.join(60)
    return crossings, entered


def main() -> None:
    for label in ("first start", "second start"):
        crossings, entered = trace_start()
        modules = ", ".join(f"{m.removeprefix('fiber_core.')} {n}" for m, n in entered.most_common())
        print(f"{label}: {crossings} module crossings to create_job ({modules})")


if __name__ == "__main__":
    main()
