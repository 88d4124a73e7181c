"""The job supervisor: runs on the SSH host, one per job, as the command of the job's channel.

The backend starts it as ``python -I -S -c <this file's source> fiber-ssh <run id>``, so
it needs nothing but the standard library and sees nothing of the job's environment.
It talks to the backend over the channel:

stdin, first line
    The job as JSON: ``{"argv": [...], "env": {...}, "cwd": ..., "orphan_timeout": s}``.
    The environment travels here, not on the command line, where ``ps`` would show
    the run's key to every user of the host.
stdin, then one command per line
    ``T``: SIGTERM to the job's process group; ``K``: SIGKILL to it; ``h``: heartbeat.
    End of file (the connection to the parent is gone) kills the group, and so does
    silence longer than ``orphan_timeout`` (the parent's host became unreachable:
    sshd would not notice for hours).
stdout, lines starting with ``@fiber``
    ``@fiber pid N`` once the job runs (N is also its process group and session),
    ``@fiber exit N`` when it ended, N as :mod:`multiprocessing` has it (``-15``
    after SIGTERM). Before the exit, ``@fiber error TEXT`` when the job could not
    start (TEXT says why), or ``@fiber oom`` when it died of a SIGKILL this
    supervisor did not send while the kernel counted an out-of-memory kill in its
    memory cgroup. Anything else there (a chatty shell startup file) is ignored.
stderr
    The job's stdout and stderr, merged: the backend keeps them as the job's log.

The job runs in a new session (``setsid``), so one signal reaches everything it
started; when the job's first process ends, what it left running in its group is
killed too. SIGTERM sent to this supervisor is passed on to the job's group (it
stays until the job ends); if the supervisor itself is killed, the job's first
process gets SIGKILL from the kernel (Linux: ``PR_SET_PDEATHSIG``), so no job is
left running that nobody can stop.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time


def _say(line: str) -> None:
    try:
        os.write(1, ("\n@fiber " + line + "\n").encode())
    except OSError:
        pass


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except OSError:
        pass


def _oom_kills() -> int | None:
    """The OOM kills the kernel counted in this process's memory cgroup (v2 or v1), or None."""
    try:
        with open("/proc/self/cgroup") as f:
            entries = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for entry in entries:
        if len(entry) != 3:
            continue
        controllers, path = entry[1].split(","), entry[2].rstrip("/")
        if entry[1] == "":
            files = [f"/sys/fs/cgroup{path}/memory.events", f"/sys/fs/cgroup/unified{path}/memory.events"]
        elif "memory" in controllers:
            files = [f"/sys/fs/cgroup/memory{path}/memory.oom_control"]
        else:
            continue
        for name in files:
            try:
                with open(name) as f:
                    for line in f:
                        if line.startswith("oom_kill "):
                            return int(line.split()[1])
            except (OSError, ValueError):
                pass
    return None


def _die_with_supervisor() -> None:
    """In the job's process, before it runs: SIGKILL when this supervisor dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the job then outlives a killed supervisor


def main() -> int:
    buf = b""
    while b"\n" not in buf:
        chunk = os.read(0, 65536)
        if not chunk:
            return 2  # the parent went away before it sent the job
        buf += chunk
    line, buf = buf.split(b"\n", 1)
    job = json.loads(line)
    env = dict(os.environ)
    env.update(job.get("env") or {})
    argv = job["argv"]
    ooms = _oom_kills()
    try:
        # No thread runs yet here, so a preexec_fn is safe; the main thread, which forks, lives
        # as long as this process (PDEATHSIG follows the forking thread).
        proc = subprocess.Popen(argv, env=env, cwd=job.get("cwd") or None, stdin=subprocess.DEVNULL,
                                stdout=2, stderr=2, start_new_session=True,
                                preexec_fn=_die_with_supervisor if sys.platform == "linux" else None)
    except OSError as e:
        where = " in " + job["cwd"] if job.get("cwd") else ""
        why = f"cannot start {argv[0]!r}{where}: {e}"
        os.write(2, f"fiber-ssh: {why}\n".encode())
        _say("error " + why.replace("\n", " "))
        _say("exit 127")
        return 127
    _say(f"pid {proc.pid}")
    signal.signal(signal.SIGTERM, lambda *_: _killpg(proc.pid, signal.SIGTERM))
    done_r, done_w = os.pipe()

    def reap() -> None:
        proc.wait()
        os.write(done_w, b"x")

    threading.Thread(target=reap, daemon=True).start()
    timeout = job.get("orphan_timeout") or None
    last = time.monotonic()
    watching = [0, done_r]
    killed = False  # this supervisor sent SIGKILL
    while True:
        wait = None
        if timeout is not None and 0 in watching:
            wait = max(0.0, last + timeout - time.monotonic())
        ready = select.select(watching, [], [], wait)[0]
        if done_r in ready:
            break
        if 0 not in ready:
            os.write(2, f"fiber-ssh: no word from the parent for {timeout:g} s: "
                        "killing the job\n".encode())
            _killpg(proc.pid, signal.SIGKILL)
            killed = True
            watching = [done_r]
            continue
        chunk = os.read(0, 65536)
        if not chunk:  # the channel closed: the parent is gone
            _killpg(proc.pid, signal.SIGKILL)
            killed = True
            watching = [done_r]
            continue
        last = time.monotonic()
        *commands, buf = (buf + chunk).split(b"\n")
        for command in commands:
            if command == b"T":
                _killpg(proc.pid, signal.SIGTERM)
            elif command == b"K":
                _killpg(proc.pid, signal.SIGKILL)
                killed = True
    code = proc.returncode
    _killpg(proc.pid, signal.SIGKILL)  # what the job left running in its group
    if code == -signal.SIGKILL and not killed and ooms is not None:
        after = _oom_kills()
        if after is not None and after > ooms:
            _say("oom")
    _say(f"exit {code}")
    return code


if __name__ == "__main__":
    code = main()
    sys.exit(code & 0xFF if code >= 0 else 128 - code)
