"""The job supervisor: runs on the SSH host, one per job, as the command of the job's channel.

The backend starts it as ``python -I -S -c <this file's source> fiber-ssh <run id>``, so
it needs nothing but the standard library and sees nothing of the job's environment.
It talks to the backend over the channel:

stdin, first line
    The job, ``{"argv": [...], "env": {...}, "cwd": ..., "orphan_timeout": s}``, as
    :mod:`marshal` data (format 4) in base64: read with two built-in modules, where
    JSON's parser would import ``re`` first. The environment travels here, not on the
    command line, where ``ps`` would show the run's key to every user of the host.
stdin, then one command per line
    ``T``: SIGTERM to the job's process group; ``K``: SIGKILL to it; ``h``: heartbeat.
    End of file (the connection to the parent is gone) kills the group, and so does
    silence longer than ``orphan_timeout`` (the parent's host became unreachable:
    sshd would not notice for hours).
stdout, lines starting with ``@fiber``
    ``@fiber pid N`` once the job runs (N is also its process group and session),
    ``@fiber exit N`` when it ended, N as :mod:`multiprocessing` has it (``-15``
    after SIGTERM). Before the exit, ``@fiber error TEXT`` when the job could not
    start (TEXT says why); ``@fiber oom`` when it died of a SIGKILL this
    supervisor did not send while the kernel counted an out-of-memory kill in its
    memory cgroup, ``@fiber killed`` when the count stood still (not an OOM kill),
    nothing of the kind where no cgroup file tells. Anything else there (a chatty
    shell startup file) is ignored.
stderr
    The job's stdout and stderr, merged: the backend keeps them as the job's log.

The job runs in a new session (``setsid``), so one signal reaches everything it
started; when the job's first process ends, what it left running in its group is
killed too. SIGTERM sent to this supervisor is passed on to the job's group (it
stays until the job ends); if the supervisor itself is killed, the job's first
process gets SIGKILL from the kernel (Linux: ``PR_SET_PDEATHSIG``), so no job is
left running that nobody can stop.

The job is started before anything else is imported: what this supervisor needs only
later (select, signal, time) loads while the job's interpreter starts.
"""

from __future__ import annotations

import binascii
import marshal
import os
import sys

_SIGKILL, _SIGTERM = 9, 15  # POSIX's numbers: the signal module is imported after the job starts


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


def _death_signal():  # noqa: ANN202 - a callable or None
    """What the job's process calls before it runs: SIGKILL when this supervisor dies.

    ``prctl(PR_SET_PDEATHSIG)``, looked up here before the fork; None where there is
    no such call (not Linux): the job then outlives a killed supervisor. Through
    ``_ctypes``, the C part of :mod:`ctypes`, where it has ``call_function``: 0.3 ms,
    where importing ``ctypes`` takes 2.3, before the job can start.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        import _ctypes

        call, prctl = _ctypes.call_function, _ctypes.dlsym(_ctypes.dlopen(None), "prctl")
        return lambda: call(prctl, (1, _SIGKILL, 0, 0, 0))
    except (ImportError, OSError, AttributeError):
        pass
    try:
        import ctypes

        slow = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: slow(1, _SIGKILL, 0, 0, 0)


def _spawn(argv: list[str], env: dict[str, str], cwd: str | None) -> int:
    """Start the job in a new session, stdin from /dev/null, stdout and stderr to ours.

    Raises the OSError that kept it from starting (its command or directory missing...),
    reported by the child through a pipe that a successful exec closes.
    """
    die_with_us = _death_signal()
    r, w = os.pipe()  # both close on exec
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setsid()
            if die_with_us is not None:
                die_with_us()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(2, 1)
            os.close(null)
            if cwd:
                os.chdir(cwd)
            os.execvpe(argv[0], argv, env)
        except BaseException as e:
            err = e if isinstance(e, OSError) else OSError(0, repr(e))
            try:
                os.write(w, marshal.dumps((err.errno or 0, err.strerror or str(err), err.filename), 4))
            finally:
                os._exit(127)
    os.close(w)
    report = b""
    while chunk := os.read(r, 65536):
        report += chunk
    os.close(r)
    if report:
        os.waitpid(pid, 0)
        errno, strerror, filename = marshal.loads(report)
        raise OSError(errno, strerror, filename)
    return pid


def _read_job() -> tuple[dict, bytes] | None:
    """The job from stdin's first line, and what came after it; None if stdin ended first."""
    buf = b""
    while b"\n" not in buf:
        chunk = os.read(0, 65536)
        if not chunk:
            return None
        buf += chunk
    line, buf = buf.split(b"\n", 1)
    return marshal.loads(binascii.a2b_base64(line)), buf


def _start(job: dict) -> int:
    """Start the job and say its pid; an OSError when it could not start, already reported."""
    env = dict(os.environ)
    env.update(job.get("env") or {})
    argv = job["argv"]
    try:
        pid = _spawn(argv, env, job.get("cwd") or None)
    except OSError as e:
        where = " in " + job["cwd"] if job.get("cwd") else ""
        why = f"cannot start {argv[0]!r}{where}: {e}"
        os.write(2, f"fiber-ssh: {why}\n".encode())
        _say("error " + why.replace("\n", " "))
        _say("exit 127")
        raise
    _say(f"pid {pid}")
    return pid


def _end_watch(pid: int, status: list[int]) -> int:
    """A descriptor readable once the job has ended; where a thread reaps it, into ``status``."""
    try:
        return os.pidfd_open(pid)  # readable once the job has ended (Linux 5.3+)
    except (AttributeError, OSError):  # elsewhere a thread reaps it and says so on a pipe
        import threading

        ended, done_w = os.pipe()

        def reap() -> None:
            status.append(os.waitpid(pid, 0)[1])
            os.write(done_w, b"x")

        threading.Thread(target=reap, daemon=True).start()
        return ended


def _obey(pid: int, commands: list[bytes]) -> bool:
    """Carry out the parent's commands; whether one was SIGKILL."""
    killed = False
    for command in commands:
        if command == b"T":
            _killpg(pid, _SIGTERM)
        elif command == b"K":
            _killpg(pid, _SIGKILL)
            killed = True
    return killed


def _supervise(pid: int, ended: int, buf: bytes, timeout: float | None) -> bool:
    """Follow the parent's commands until the job ends; whether this supervisor killed it."""
    import select
    import time

    last = time.monotonic()
    watching = [0, ended]
    killed = False
    while True:
        wait = None
        if timeout is not None and 0 in watching:
            wait = max(0.0, last + timeout - time.monotonic())
        ready = select.select(watching, [], [], wait)[0]
        if ended in ready:
            return killed
        if 0 not in ready:
            os.write(2, f"fiber-ssh: no word from the parent for {timeout:g} s: "
                        "killing the job\n".encode())
        chunk = os.read(0, 65536) if 0 in ready else b""
        if not chunk:  # silence past the timeout, or the channel closed: the parent is gone
            _killpg(pid, _SIGKILL)
            killed = True
            watching = [ended]
            continue
        last = time.monotonic()
        *commands, buf = (buf + chunk).split(b"\n")
        killed = _obey(pid, commands) or killed


def main() -> int:
    got = _read_job()
    if got is None:
        return 2  # the parent went away before it sent the job
    job, buf = got
    ooms = _oom_kills()
    try:
        pid = _start(job)
    except OSError:
        return 127
    import signal  # the job is starting meanwhile

    signal.signal(signal.SIGTERM, lambda *_: _killpg(pid, _SIGTERM))
    status: list[int] = []  # the job's wait status, once reaped
    ended = _end_watch(pid, status)
    killed = _supervise(pid, ended, buf, job.get("orphan_timeout") or None)
    if not status:  # the pidfd said it ended: reap it
        status.append(os.waitpid(pid, 0)[1])
    code = os.waitstatus_to_exitcode(status[0])
    _killpg(pid, _SIGKILL)  # what the job left running in its group
    if code == -_SIGKILL and not killed and ooms is not None:
        after = _oom_kills()
        if after is not None:
            _say("oom" if after > ooms else "killed")
    _say(f"exit {code}")
    return code


if __name__ == "__main__":
    code = main()
    sys.exit(code & 0xFF if code >= 0 else 128 - code)
