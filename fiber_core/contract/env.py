"""The environment variables Fiber sets in every job: part of what a backend passes on.

A backend copies ``JobSpec.env`` into the job as it is. The run's key is a secret:
whoever reads it can reach the parent and have it unpickle what they send, so a backend
never logs it or shows it in anything others can list, and the job takes it out of its
environment once read (:data:`SECRET_VARIABLES` says what goes with it, and why the
tokens need not be hidden as the key is).
"""

from __future__ import annotations

ENV_RUN_ID = "FIBER_RUN_ID"
"""The run's id: every process of one program shares it (and labels its jobs with it)."""
ENV_AUTHKEY = "FIBER_AUTHKEY"
"""The run's key, hex: every connection between its processes is authenticated with it."""
ENV_HUB = "FIBER_PARENT_HUB"
"""Where the job reaches its parent: ``unix:PATH,tcp:HOST:PORT``."""
ENV_TOKEN = "FIBER_PROCESS_TOKEN"
"""Which of its parent's processes the job is (a random token, one per job)."""

ENV_GROUP = "FIBER_GROUP"
"""Set instead of a token of its own for a job started in a group (``Backend.start_jobs``):
the group's secret, from which each member's token derives (:func:`group_token`)."""
ENV_GROUP_INDEX = "FIBER_GROUP_INDEX"
"""The job's place in its group (0, 1, ...). A backend that starts the group as one
platform job (an array job) may leave :data:`ENV_TOKEN` and this out of the children's
common environment and set this one from the platform's own index in each child."""

ENV_PARENT_PID = "FIBER_PARENT_PID"
"""Set by a backend whose jobs are child processes of the parent (the local backend): the
parent's pid. The job then ends the moment its parent does, whatever its own code is
doing (see :mod:`fiber_core.processes.worker`)."""

ENV_PARENT_CHANNEL = "FIBER_PARENT_CHANNEL"
"""Set in a local job forked by the local backend's template: the descriptor of its end of
a socket pair that its parent made for it (:attr:`~fiber_core.contract.backend.Job.channel`),
on which the job talks to its parent instead of dialing :data:`ENV_HUB`."""

ENV_PARENT_RUNDIR = "FIBER_PARENT_RUNDIR"
"""The parent's run directory (a path on the parent's machine). A job that finds it (a
directory of its user) keeps its own run files there, and multiprocessing's temp files
too, so that the parent's exit removes them whatever the job's end; elsewhere it is unused."""

ENV_JOB_HOST = "FIBER_JOB_HOST"
"""Set by a backend that runs jobs on machines other than the parent's, where its jobs on
one machine share that machine's ``/dev/shm``: the machine's name (as in ``Job.host``).
Processes of a run with the same value (unset: the parent's machine, or a machine of
its own, like a pod or a container with a ``/dev/shm`` of its own) keep one copy of a
broadcast value between them (:mod:`fiber_core.parallel.broadcast`). A backend that
leaves it unset on other machines costs one copy per job, never a wrong value."""

SECRET_VARIABLES = frozenset({ENV_AUTHKEY, ENV_TOKEN, ENV_GROUP})
"""What a job takes out of its environment once read, so that nothing it starts inherits it;
and what a backend hides from those who can list its jobs where that costs nothing.

Only the key must be hidden. A token (or a group's secret, from which the tokens of its
members derive) names one process of the parent, and the parent reads it only from a
client that has proved it holds the key: without the key a token opens nothing, and with
the key it adds nothing (the key alone lets its holder send the parent what it unpickles).
So a backend that gives its jobs the key by a channel of its own may leave the tokens in
the plain job definition: the kubernetes backend's pod spec and AWS Batch's
``DescribeJobs`` show them; docker's and ssh's channel carries them with the key."""

PER_MEMBER_VARIABLES = frozenset({ENV_TOKEN, ENV_GROUP_INDEX})
"""What differs between the environments of a group's members: a backend that starts the
group as one array job drops these and sets :data:`ENV_GROUP_INDEX` in each child."""


def group_token(group: str, index: int) -> str:
    """The token of member ``index`` of the group whose secret is ``group``."""
    import hashlib

    return hashlib.sha256(f"{group}:{index}".encode()).hexdigest()[:32]


def job_token(environ: dict[str, str] | None = None) -> str:
    """This job's token: its own, or the one its group's secret and its index give."""
    import os

    env = os.environ if environ is None else environ
    token = env.get(ENV_TOKEN)
    if token:
        return token
    if env.get(ENV_GROUP) and env.get(ENV_GROUP_INDEX, "").isdigit():
        return group_token(env[ENV_GROUP], int(env[ENV_GROUP_INDEX]))
    raise KeyError(f"{ENV_TOKEN} (or {ENV_GROUP} and {ENV_GROUP_INDEX}) is not set: "
                   "this process was not started by Fiber")

__all__ = ["ENV_AUTHKEY", "ENV_GROUP", "ENV_GROUP_INDEX", "ENV_HUB", "ENV_JOB_HOST", "ENV_PARENT_CHANNEL",
           "ENV_PARENT_PID", "ENV_PARENT_RUNDIR", "ENV_RUN_ID",
           "ENV_TOKEN", "PER_MEMBER_VARIABLES", "SECRET_VARIABLES", "group_token", "job_token"]
