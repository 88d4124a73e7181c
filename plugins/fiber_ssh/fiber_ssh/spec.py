"""The job on an SSH host: pure translations of a :class:`~fiber_core.contract.JobSpec` into the
command that starts the job supervisor (:mod:`fiber_ssh.supervisor`) and the job line it reads
on its stdin (argv, environment, working directory). No connection."""

from __future__ import annotations

import base64
import marshal
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

from fiber_core.contract import ENV_JOB_HOST

SUPERVISOR = Path(__file__).with_name("supervisor.py").read_text().split('"""\n', 1)[1].lstrip()
"""The supervisor's code without its docstring: it is on the command line of every job."""


def supervisor_command(python: str, run_id: str) -> str:
    """The shell command that runs the supervisor with ``python`` (isolated, no site)."""
    return (f"exec {shlex.quote(python)} -I -S -c {shlex.quote(SUPERVISOR)} "
            f"fiber-ssh {shlex.quote(run_id or '-')}")


def job_env(env: Mapping[str, str], hostname: str, gpus: Sequence[int]) -> dict[str, str]:
    """The job's environment on ``hostname``: ``env``, the host's name (its jobs share one copy
    of a broadcast value there) and, with ``gpus`` placed, ``CUDA_VISIBLE_DEVICES``."""
    out = {**env, ENV_JOB_HOST: hostname}
    if gpus:
        out["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    return out


def job_line(argv: Sequence[str], env: Mapping[str, str], cwd: str | None, orphan_timeout: float | None) -> bytes:
    """The line the supervisor reads on its stdin: the job, marshalled and base64-encoded."""
    return base64.b64encode(marshal.dumps({"argv": list(argv), "env": dict(env), "cwd": cwd,
                                           "orphan_timeout": orphan_timeout or None}, 4)) + b"\n"
