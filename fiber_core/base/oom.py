"""The kernel's count of out-of-memory kills in this process's memory cgroup: an OOM kill told from another SIGKILL.

The OOM killer ends a process with SIGKILL, as an operator's ``kill -9`` does. The
memory cgroup counts its kills (``oom_kill`` in ``memory.events`` on cgroup v2, in
``memory.oom_control`` on v1): a job SIGKILLed while the count stood still was not
killed for memory. A job on this machine stays in the cgroup of the process that
started it, so reading the count when the job starts and again when it ends tells
the two apart (an OOM kill of a sibling in between makes the answer "perhaps",
never a wrong "no").
"""

from __future__ import annotations

_CGROUP_ROOT = "/sys/fs/cgroup"


def counter_files(proc_cgroup: str, root: str = _CGROUP_ROOT) -> list[str]:
    """The files that may hold the OOM-kill count, given the text of ``/proc/self/cgroup``."""
    files = []
    for line in proc_cgroup.splitlines():
        entry = line.split(":", 2)
        if len(entry) != 3:
            continue
        path = entry[2].rstrip("/")
        if entry[1] == "":  # v2: one hierarchy
            files += [f"{root}{path}/memory.events", f"{root}/unified{path}/memory.events"]
        elif "memory" in entry[1].split(","):
            files.append(f"{root}/memory{path}/memory.oom_control")
    files.append(f"{root}/memory.events")  # a container's own cgroup shown as its root
    return files


def parse_count(text: str) -> int | None:
    """The ``oom_kill`` count in the text of ``memory.events`` or ``memory.oom_control``."""
    for line in text.splitlines():
        if line.startswith("oom_kill "):
            try:
                return int(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None


def oom_kills() -> int | None:
    """The OOM kills counted in this process's memory cgroup so far, or None where no
    cgroup file says (not Linux, no memory controller): then an OOM kill cannot be told."""
    try:
        with open("/proc/self/cgroup") as f:
            files = counter_files(f.read())
    except OSError:
        files = counter_files("")
    for name in files:
        try:
            with open(name) as f:
                count = parse_count(f.read())
        except OSError:
            continue
        if count is not None:
            return count
    return None
