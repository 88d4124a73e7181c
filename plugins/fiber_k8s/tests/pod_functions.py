"""Functions that jobs of the tests run in pods: standard library only, because the pods run
the `fiber-test` image (Python and fiber-core). The tests directory is mounted in every pod
at the same path (the ``volumes`` setting, a hostPath), so workers import this module by name.
"""

from __future__ import annotations

import os


def square(x: int) -> int:
    return x * x


def pod_name() -> str:
    """The name of the pod this runs in (POD_NAME, set by the backend from the Downward API)."""
    return os.environ.get("POD_NAME", "")


def put_square(q, x: int) -> None:  # noqa: ANN001 - a fiber_core.Queue
    q.put(x * x)


def ms_task(x: int) -> int:
    """1-5 ms of work, for maps under preemption."""
    import time

    time.sleep(0.001 + (x % 5) * 0.001)
    return x


def put_env(q, name: str) -> None:  # noqa: ANN001 - a fiber_core.Queue
    q.put(os.environ.get(name))


def put_environ(q, names: list[str]) -> None:  # noqa: ANN001 - a fiber_core.Queue
    q.put({n: os.environ.get(n) for n in names})


def meet(x: int, barrier) -> str:  # noqa: ANN001 - a fiber_core.Barrier
    """Returns once every party holds a task at once: the pool has that many running workers."""
    barrier.wait(120)
    return os.environ.get("POD_NAME", "")


def put_rank(q, rank: int, size: int) -> None:  # noqa: ANN001 - a fiber_core.Queue
    q.put((rank, size))


def resources() -> str:
    """What this job got (``current_process().resources``), as JSON."""
    import json

    import fiber_core

    return json.dumps(fiber_core.current_process().resources)


def on_demand_only() -> str:
    """What this job got (as :func:`resources`) once it runs on on-demand capacity; on any other
    it waits to be preempted."""
    import json
    import time

    import fiber_core

    got = fiber_core.current_process().resources
    if got["capacity"] != "on-demand":
        time.sleep(600)
    return json.dumps(got)
