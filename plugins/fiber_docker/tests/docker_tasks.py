"""What the tests run in containers: a module of their own, with no import beyond the stdlib.

Pool workers unpickle these functions by reference, so the containers import this
module: they find it because the backend mounts the working directory (the source
tree) at the same path, and the worker appends the parent's ``sys.path``.
"""

from __future__ import annotations

import os
import sys
import time


def square(x: int) -> int:
    return x * x


def init_process() -> str:
    """PID 1's command line in the container: ``docker-init`` proves it is one."""
    with open("/proc/1/cmdline", "rb") as f:
        return f.read().split(b"\0")[0].decode()


def where(x: int) -> tuple[int, str, str]:
    return x, init_process(), os.getcwd()


def slow_square(x: int) -> int:
    time.sleep(0.2)  # the workload: long enough that a worker is mid-task when it is killed
    return x * x


def fail(x: int) -> None:
    raise ValueError(f"bad item {x}")


def exit_with(code: int) -> None:
    sys.exit(code)


def sleep_forever(q) -> None:  # noqa: ANN001
    q.put("up")
    time.sleep(3600)


def report_environ(q, names) -> None:  # noqa: ANN001
    """Put the values of ``names`` in this job's environment (None where unset), then wait."""
    q.put({n: os.environ.get(n) for n in names})
    time.sleep(3600)


def getenv(name: str) -> str | None:
    return os.environ.get(name)


def echo_squares(inbox, outbox) -> None:  # noqa: ANN001
    while True:
        x = inbox.get()
        if x is None:
            break
        outbox.put((x, x * x, init_process()))


def consume(jq, results) -> None:  # noqa: ANN001
    while True:
        x = jq.get()
        try:
            if x is None:
                return
            results.put(x + 1)
        finally:
            jq.task_done()


def put_square(q, x: int) -> None:  # noqa: ANN001
    q.put(x * x)


def allocate(mib: int, runs) -> int:  # noqa: ANN001
    """Tell ``runs`` it runs, then hold ``mib`` MiB: past a container's memory limit."""
    runs.put("ran")
    block = b"x" * (mib << 20)
    return len(block)


def sigkill_own_worker() -> None:
    """SIGKILL its own worker: a kill, not the OOM killer's."""
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def ms_task(x: int) -> int:
    """1-5 ms of work, for maps under preemption."""
    time.sleep(0.001 + (x % 5) * 0.001)
    return x


def read_broadcast(handle: object) -> tuple[int, list[int], bool, str]:
    """What a broadcast gives in a container: its version, its distinct bytes, whether it
    is the container's shared copy, and which job read it (its worker's name: the job's token
    leaves its environment once the worker has read it)."""
    import fiber_core

    view = handle.value  # type: ignore[attr-defined]
    return (handle.version, sorted(set(bytes(view))), handle.shared,  # type: ignore[attr-defined]
            fiber_core.current_process().name)


def container_of(q, code: int) -> None:  # noqa: ANN001
    import re

    with open("/proc/self/mountinfo") as f:  # Docker mounts /etc/hosts from the container's directory
        q.put(re.search(r"/containers/([0-9a-f]{64})/", f.read()).group(1))  # type: ignore[union-attr]
    sys.exit(code)


def logged_task(x: int, where: str) -> tuple[int, str]:
    """Record a run of ``x`` in ``where`` (a file per run: the task log a fault test reads),
    do ~20 ms of work, return ``x`` and the name of the worker that ran it."""
    import fiber_core

    fd = os.open(os.path.join(where, f"{x}.{os.getpid()}.{time.monotonic_ns()}"),
                 os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    os.close(fd)
    time.sleep(0.02)  # the task's work
    return x, fiber_core.current_process().name
