"""The job on an SSH host as fiber_ssh.spec writes it: pure, no host."""

from __future__ import annotations

import base64
import marshal
import shlex

from fiber_ssh.spec import SUPERVISOR, job_env, job_line, supervisor_command


def test_the_job_line_is_what_the_supervisor_reads() -> None:
    line = job_line(["python3", "-m", "w"], {"A": "1"}, "/w", 0.0)
    assert line.endswith(b"\n") and b"\n" not in line[:-1]
    assert marshal.loads(base64.b64decode(line)) == {"argv": ["python3", "-m", "w"], "env": {"A": "1"},
                                                      "cwd": "/w", "orphan_timeout": None}  # 0: forever
    assert marshal.loads(base64.b64decode(job_line([], {}, None, 30.0)))["orphan_timeout"] == 30.0


def test_a_job_knows_its_host_and_only_its_gpus() -> None:
    assert job_env({"A": "1"}, "h1", []) == {"A": "1", "FIBER_JOB_HOST": "h1"}
    assert job_env({}, "h1", [0, 2])["CUDA_VISIBLE_DEVICES"] == "0,2"


def test_the_supervisor_runs_isolated_with_the_run_id() -> None:
    argv = shlex.split(supervisor_command("/opt/py 3/bin/python", ""))
    assert argv[:5] == ["exec", "/opt/py 3/bin/python", "-I", "-S", "-c"]
    assert argv[5] == SUPERVISOR and argv[6:] == ["fiber-ssh", "-"]
    assert not SUPERVISOR.startswith('"""')  # its docstring is not sent with every job
