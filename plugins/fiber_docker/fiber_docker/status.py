"""What the daemon says of a container, as its job's end: pure translations of exit statuses,
``oom`` and ``kill`` events, and the image check's output. No call to the daemon."""

from __future__ import annotations

import re
import signal
import sys
from dataclasses import dataclass, field
from typing import Any

from fiber_core.contract import EndReason, exitcode_from_status, install_elsewhere

START_FAILED = 125
"""Exit code of a job whose container the daemon refused to start (``docker run``'s)."""


def exitcode(status: Any) -> int:
    """``multiprocessing``'s exit code of the daemon's ``128 + N`` status."""
    return exitcode_from_status(int(status)) or 0


def thaw_to_signal(sig: str, paused: bool) -> bool:
    """Whether a container must be unpaused for ``sig`` to reach it: the daemon thaws a paused
    container itself only for SIGKILL and for its image's ``STOPSIGNAL``; any other signal
    waits in the frozen processes, and so would the job's end."""
    return paused and sig != "SIGKILL"


def container_end(code: int, *, oom: bool | None, outside_signal: str | None, stop_requested: bool,
                  memory: int | None) -> tuple[EndReason | None, str]:
    """Why a container that exited with ``code`` ended, and what to say of it.

    ``oom``: the daemon reported an ``oom`` event or ``State.OOMKilled`` (True), its
    ``State.OOMKilled`` is false (False), or it could not say: the container was removed
    before it was inspected (None). It says the exit was the OOM kill only with SIGKILL's
    code; a SIGKILL with ``OOMKilled`` false that neither Fiber nor a ``docker kill`` sent (a
    ``kill -9`` inside the container, an agent on the host) is KILLED. ``outside_signal``: the
    signal of a ``kill`` event this backend did not cause (``docker stop`` or ``docker kill`` by
    someone else). ``None`` for the reason: its own exit, or STOPPED when Fiber asked for it.
    """
    if code == -signal.SIGKILL and oom:
        return EndReason.OOM, (f"OOMKilled: out of memory, over the container's limit of {memory} MiB"
                               if memory else "OOMKilled: out of memory (no memory limit was set)")
    if outside_signal is not None and code < 0 and not stop_requested:
        return EndReason.PREEMPTED, (f"stopped from outside Fiber: the daemon sent signal {outside_signal} "
                                     "(docker stop or docker kill)")
    if code == -signal.SIGKILL and oom is False and not stop_requested:
        return EndReason.KILLED, "killed by SIGKILL inside the container; the daemon says OOMKilled: false"
    return None, ""


@dataclass
class ImageCheck:
    """What the check of an image found: whether jobs can run there, and why not."""

    ok: bool
    message: str = ""
    transient: bool = False
    warnings: list[str] = field(default_factory=list)


def check_verdict(status: int | None, out: str, python: str, shown: str, timeout: float,
                  core_version: str | None) -> ImageCheck:
    """The image check's verdict from the check container's exit ``status`` (None: it did
    not finish in ``timeout`` seconds) and output ``out``."""
    if status is None:
        return ImageCheck(False, f"image {shown}: `{python} -c 'import fiber_core'` did not "
                                 f"finish within {timeout:.0f} s; is the daemon overloaded?", transient=True)
    if status == 0:
        check = ImageCheck(True)
        found = re.search(r"fiber-check (\d+) (\d+) (\S+)", out)
        if found:
            major, minor, version = found.groups()
            here = f"{sys.version_info[0]}.{sys.version_info[1]}"
            if f"{major}.{minor}" != here:
                check.warnings.append(f"image {shown} runs Python {major}.{minor} and this process {here}: "
                                      "functions and lambdas defined in __main__ travel as bytecode and "
                                      "may fail to load")
            if core_version and version != core_version:
                check.warnings.append(f"image {shown} has fiber-core {version} and this process {core_version}")
        return check
    tail = "\n".join(out.strip().splitlines()[-5:])
    if status == 127 or "exec" in out and "failed" in out and python in out:
        return ImageCheck(False, f"image {shown} has no {python!r} (the check exited {status}: "
                                 f"{tail}). Jobs run `{python} -m fiber_core.processes.worker`: use an image "
                                 "with Python and fiber-core, or set the python setting "
                                 "(FIBER_PYTHON) to the interpreter's path in the image")
    if "No module named 'fiber_core'" in out:
        return ImageCheck(False, f"image {shown} has Python but not fiber-core (`{python} -c "
                                 "'import fiber_core'` failed). Install it in the image, the "
                                 f"version this process runs: {install_elsewhere(image=True)}")
    return ImageCheck(False, f"image {shown} cannot run the fiber worker: `{python} -c "
                             f"'import fiber_core'` exited {status}:\n{tail}")
