"""The job supervisor run on this machine, without SSH: its stdin and stdout protocol."""

from __future__ import annotations

import base64
import marshal
import os
import select
import signal
import subprocess
import sys

import pytest
from fiber_core.base.oom import oom_kills

from fiber_ssh.spec import SUPERVISOR as _SUPERVISOR

T = 30.0

WITHOUT_PIDFD = ("import os, sys; del os.pidfd_open; "  # a Linux before 5.3: a thread reaps the job
                 "exec(compile(sys.argv.pop(1), 'supervisor', 'exec'), {'__name__': '__main__'})")


class Supervisor:
    """The supervisor run as the backend runs it (``-I -S -c``), with ``argv`` as its job."""

    def __init__(self, argv: list[str], cwd: str | None = None, pidfd: bool = True,
                 code: list[str] | None = None) -> None:
        job = {"argv": argv, "env": {"SUPERVISED": "yes"}, "cwd": cwd, "orphan_timeout": None}
        code = code or ([_SUPERVISOR] if pidfd else [WITHOUT_PIDFD, _SUPERVISOR])
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", *code, "fiber-ssh", "test"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert self.proc.stdin is not None
        self.proc.stdin.write(base64.b64encode(marshal.dumps(job, 4)) + b"\n")
        self.proc.stdin.flush()
        self.said: list[str] = []

    def next_word(self) -> str:
        """The next ``@fiber`` line (blocks; the test's timeout bounds it)."""
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline().decode()
            assert line, f"the supervisor ended; it said {self.said}"
            if line.startswith("@fiber "):
                self.said.append(line[len("@fiber "):].strip())
                return self.said[-1]

    def send(self, command: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + b"\n")
        self.proc.stdin.flush()

    def finish(self) -> tuple[int, list[str], str]:
        """Close its stdin (the parent is gone); its status, all it said, its stderr."""
        out, err = self.proc.communicate(timeout=T)
        self.said += [x[len("@fiber "):] for x in out.decode().splitlines() if x.startswith("@fiber ")]
        return self.proc.returncode, self.said, err.decode()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "thread"])
def test_a_job_runs_and_its_exit_is_reported(pidfd: bool) -> None:
    sup = Supervisor(["sh", "-c", 'echo "out $SUPERVISED"; echo err >&2; exit 3'], pidfd=pidfd)
    assert sup.next_word().startswith("pid ")
    assert sup.next_word() == "exit 3"
    code, _, err = sup.finish()
    assert code == 3
    assert "out yes" in err and "err" in err  # the job's stdout and stderr go to the log


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "thread"])
def test_a_signal_sent_through_the_supervisor_ends_the_job(pidfd: bool) -> None:
    # Its session, field 6 of /proc/PID/stat.
    job = 'read -r _ _ _ _ _ sid _ < /proc/$$/stat; echo "sid $sid pid $$" >&2; exec sleep 600'
    sup = Supervisor(["sh", "-c", job], pidfd=pidfd)
    pid = int(sup.next_word().split()[1])
    assert sup.proc.stderr is not None
    assert " ".join(sup.proc.stderr.readline().decode().split()) == f"sid {pid} pid {pid}"  # its own session
    sup.send(b"T")  # SIGTERM to the job's group
    assert sup.next_word() == f"exit {-signal.SIGTERM}"
    code, _, _ = sup.finish()
    assert code == 128 + signal.SIGTERM


@pytest.mark.timeout(60)
def test_the_job_is_killed_when_the_parent_is_gone() -> None:
    sup = Supervisor(["sleep", "600"])
    assert sup.next_word().startswith("pid ")
    code, said, _ = sup.finish()  # stdin closes: the channel to the parent is gone
    assert said[-1] == f"exit {-signal.SIGKILL}" and code == 128 + signal.SIGKILL


WITHOUT_CTYPES_CALL = ("import _ctypes, sys; del _ctypes.call_function; "  # ctypes itself, then
                       "exec(compile(sys.argv.pop(1), 'supervisor', 'exec'), {'__name__': '__main__'})")

READ_DEATH_SIGNAL = ("import ctypes, time; sig = ctypes.c_int(); "
                     "ctypes.CDLL(None).prctl(2, ctypes.byref(sig)); "  # PR_GET_PDEATHSIG
                     "print('death signal', sig.value, flush=True); time.sleep(600)")


@pytest.mark.timeout(60)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("how", ["_ctypes", "ctypes"])
def test_a_job_gets_sigkill_from_the_kernel_when_its_supervisor_is_killed(how: str) -> None:
    sup = Supervisor([sys.executable, "-c", READ_DEATH_SIGNAL],
                     code=[WITHOUT_CTYPES_CALL, _SUPERVISOR] if how == "ctypes" else None)
    pid = int(sup.next_word().split()[1])
    assert sup.proc.stderr is not None
    assert sup.proc.stderr.readline().decode().split() == ["death", "signal", str(signal.SIGKILL)]
    ended = os.pidfd_open(pid)  # readable once the job has ended (not our child to wait for)
    try:
        sup.proc.kill()  # the supervisor dies at once: nothing of it runs to end the job
        sup.proc.wait(T)
        assert select.select([ended], [], [], T)[0], f"job {pid} outlived its supervisor"
    finally:
        os.close(ended)


@pytest.mark.parametrize("argv, cwd, words", [
    (["/nonexistent/program"], None, "cannot start '/nonexistent/program': [Errno 2]"),
    (["true"], "/nonexistent/dir", "cannot start 'true' in /nonexistent/dir: [Errno 2]"),
])
def test_a_job_that_cannot_start_says_why(argv: list[str], cwd: str | None, words: str) -> None:
    code, said, err = Supervisor(argv, cwd=cwd).finish()
    assert code == 127
    assert said[0].startswith("error " + words) and said[-1] == "exit 127", said
    assert words in err



@pytest.mark.timeout(60)
def test_a_job_that_sigkills_itself_is_said_killed_where_the_cgroup_counts_no_oom_kill() -> None:
    before = oom_kills()  # this machine's count, read as the supervisor reads its own
    sup = Supervisor(["sh", "-c", "kill -9 $$"])
    assert sup.next_word().startswith("pid ")
    last = sup.next_word()
    after = oom_kills()
    if before is None or after is None:  # no memory cgroup file: it cannot tell, and says nothing
        assert last == f"exit {-signal.SIGKILL}"
    else:
        assert last == ("oom" if after > before else "killed")
        assert sup.next_word() == f"exit {-signal.SIGKILL}"
    code, _, _ = sup.finish()
    assert code == 128 + signal.SIGKILL
