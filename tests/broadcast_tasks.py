"""What the broadcast tests run in jobs: each reads a handle and reports what it saw.

Importable in containers and on SSH hosts too: stdlib, numpy and fiber_core only.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

_held: Any = None


def keep(handle: Any) -> None:
    """A Pool initializer: the handle stays in a global, read by later tasks."""
    global _held
    _held = handle


def mapping_of(view: Any) -> tuple[str, int] | None:
    """The file (path, inode) whose mapping holds ``view``'s memory in this process."""
    import numpy as np

    address = np.asarray(view).__array_interface__["data"][0]
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi and len(fields) >= 6:
                return fields[5], int(fields[4])
    return None


def summary(handle: Any = None) -> dict[str, Any]:
    """Read ``handle`` (or the initializer's) once: its version and what its array holds."""
    import numpy as np

    handle = _held if handle is None else handle
    value = handle.value
    arr = value["table"] if isinstance(value, dict) else value
    arr = np.asarray(arr)
    return {
        "version": handle.version,
        "values": sorted({float(x) for x in np.unique(arr)}),
        "writeable": bool(arr.flags.writeable),
        "shared": handle.shared,
        "mapping": mapping_of(arr),
        "pid": os.getpid(),
        "tag": value.get("tag") if isinstance(value, dict) else None,
    }


def as_host(host: str) -> None:
    """A Pool initializer: this worker is a process of machine ``host``."""
    from fiber_core.contract.env import ENV_JOB_HOST

    os.environ[ENV_JOB_HOST] = host


def summary_together(barrier: Any, handle: Any) -> dict[str, Any]:
    """:func:`summary`, once every party of ``barrier`` holds a task: each in its own worker."""
    barrier.wait(60)
    return summary(handle)


def read_as_host(handle: Any, host: str, out: Any, hold: Any = None) -> None:
    """Read as a process of machine ``host`` would (its own directory of copies); then
    stay, while ``hold`` is given and not set, as a user of that directory."""
    from fiber_core.contract.env import ENV_JOB_HOST

    os.environ[ENV_JOB_HOST] = host
    out.put(summary(handle))
    if hold is not None:
        hold.wait(60)


def die_while_fetching(handle: Any, host: str, shm_dir: str) -> None:
    """Read as ``host``, and be killed the moment the half-written copy appears."""
    from fiber_core.contract.env import ENV_JOB_HOST

    os.environ[ENV_JOB_HOST] = host
    seen = threading.Event()

    def watch() -> None:
        import time

        while not seen.is_set():
            try:
                if any(".part." in name for name in os.listdir(shm_dir)):
                    os.kill(os.getpid(), signal.SIGKILL)
            except FileNotFoundError:
                pass
            time.sleep(0.001)

    threading.Thread(target=watch, daemon=True).start()
    handle.value  # noqa: B018 - the read is what is killed
    seen.set()


def read_in_loop(handle: Any, until: Any, out: Any, progress: Any, host: str = "") -> None:
    """Read (as ``host``) until ``until`` is set; report every read's (version, distinct
    values) at the end, and on ``progress`` each new version as it is first seen."""
    import numpy as np

    if host:
        as_host(host)
    seen: list[tuple[int, list[float]]] = []
    while not until.is_set():
        arr = handle.value
        seen.append((handle.version, [float(x) for x in np.unique(arr)]))
        if len(seen) == 1 or seen[-1][0] != seen[-2][0]:
            progress.put((host, handle.version))
    out.put(seen)
