"""The scorecard's fault kinds and backends, and where a kind cannot be produced (pure, no I/O).

A cell that cannot be produced is never run: the table says ``n/a`` and a footnote gives
:func:`not_applicable`'s reason.
"""

from __future__ import annotations

KINDS = ("none", "kill", "term", "stop", "heal", "cut", "loss", "restart")
"""The fault kinds, in the order of the table's columns (``none``: undisturbed). A kind's
schedule seed is the first seed plus its place here, so adding kinds at the end leaves the
seeds of the others as they were."""

SIGNALS = ("kill", "term", "stop")
"""The kinds that signal one worker's process (``tests/chaos.py``'s)."""

PARTITIONS = ("heal", "cut")
"""The kinds that cut one worker's host off from the master: for ``HEAL_SECONDS``, or for good."""

HEAL_SECONDS = 20.0
"""How long a ``heal`` partition lasts (the issue's: longer than the default heartbeat bound, 15 s)."""

LOSS_PROBABILITY = 0.01
"""The share of packets dropped (and, as the SSH fault tests do, duplicated) under ``loss``."""

RESTART_SECONDS = 10.0
"""How long the platform's API refuses connections under ``restart``."""

BACKENDS = ("local", "docker", "ssh", "kubernetes")
"""Fiber's backends that the test services provide here, in the order of the table's rows."""

DESCRIPTIONS = {
    "none": "undisturbed: the reference for the others' time",
    "kill": "SIGKILL to a worker's process (a crash, an out-of-memory kill)",
    "term": "SIGTERM to a worker's process (a preemption notice, `docker stop`, a pod's deletion)",
    "stop": "SIGSTOP to a worker's process (a frozen worker: alive, its socket open, silent)",
    "heal": f"every packet between a worker's host and the master dropped, both ways, for "
            f"{HEAL_SECONDS:g} s, then let through again",
    "cut": "every packet between a worker's host and the master dropped, both ways, until the end",
    "loss": f"{LOSS_PROBABILITY:.0%} of the packets between every host and the master dropped and "
            f"{LOSS_PROBABILITY:.0%} duplicated, both ways, from the fault's point to the end",
    "restart": f"the platform's API (dockerd, the Kubernetes API server) resets every connection "
               f"and refuses new ones for {RESTART_SECONDS:g} s, then answers again with its state; "
               f"a worker is SIGKILLed as it goes away, so that its replacement waits for the API",
}

PEERS_LOCAL = "the peers run on this machine only: there is no host to cut off or link to degrade"
NO_PLATFORM = "no platform API: the jobs are this machine's processes (peers, Fiber's local backend)"
LOCAL_LINKS = ("the local backend's workers talk to the master over Unix sockets on this machine "
               "(a partition would need an iptables cgroup match on each worker; not done)")
HOST_NETWORK = ("the containers use this machine's network (host networking): a partition of one "
                "would need an iptables cgroup match on its cgroup; not done")
SSH_API = ("the ssh backend has no platform API: each host's sshd only starts jobs, and a host that "
           "stops answering is a host lost, as under `cut`")


def not_applicable(library: str, backend: str | None, kind: str) -> str | None:
    """Why ``kind`` cannot be produced for ``library`` (on ``backend``, for Fiber); None where it can."""
    if kind in ("none", *SIGNALS):
        return None
    network = kind in (*PARTITIONS, "loss")
    if library != "fiber":
        return PEERS_LOCAL if network else NO_PLATFORM
    if network:
        return {"local": LOCAL_LINKS, "ssh": None}.get(backend or "local", HOST_NETWORK)
    return {"local": NO_PLATFORM, "ssh": SSH_API}.get(backend or "local")  # restart


def fault_count(kind: str, faults: int) -> int:
    """How many faults a kind's schedule has: none for ``none``; one for ``cut`` (with three
    hosts, three cuts for good could leave no host at all) and ``loss`` (it lasts to the end);
    ``faults`` for the others."""
    if kind == "none":
        return 0
    return 1 if kind in ("cut", "loss") else faults
