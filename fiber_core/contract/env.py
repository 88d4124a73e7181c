"""The environment variables Fiber sets in every job: part of what a backend passes on.

A backend copies ``JobSpec.env`` into the job as it is. Two of these values are
secrets (:data:`SECRET_VARIABLES`): whoever reads them can reach the parent and have
it unpickle what they send, so a backend never logs them or shows them in anything
others can list. A backend whose job specs others can read passes them another way:
a platform secret, or the job's stdin (:func:`secrets_on_stdin`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import BinaryIO

ENV_RUN_ID = "FIBER_RUN_ID"
"""The run's id: every process of one program shares it (and labels its jobs with it)."""
ENV_AUTHKEY = "FIBER_AUTHKEY"
"""The run's key, hex: every connection between its processes is authenticated with it."""
ENV_HUB = "FIBER_PARENT_HUB"
"""Where the job reaches its parent: ``unix:PATH,tcp:HOST:PORT``."""
ENV_TOKEN = "FIBER_PROCESS_TOKEN"
"""Which of its parent's processes the job is (a random token, one per job)."""

SECRET_VARIABLES = frozenset({ENV_AUTHKEY, ENV_TOKEN})
"""The variables of a job's environment that must not be readable by others."""
ENV_SECRETS_ON_STDIN = "FIBER_SECRETS_ON_STDIN"
"""Set to ``1`` by a backend that sends the secret variables on the job's stdin instead of
its environment (:func:`secrets_on_stdin`): the worker reads them there before anything else."""


def secrets_on_stdin(env: Mapping[str, str]) -> tuple[dict[str, str], bytes]:
    """``env`` without its secret variables (and with :data:`ENV_SECRETS_ON_STDIN`), and what to
    write on the job's stdin for them: ``NAME=VALUE`` lines, then an empty line."""
    public = {k: v for k, v in env.items() if k not in SECRET_VARIABLES}
    lines = "".join(f"{k}={env[k]}\n" for k in sorted(SECRET_VARIABLES) if k in env)
    public[ENV_SECRETS_ON_STDIN] = "1"
    return public, (lines + "\n").encode()


def read_secrets(stream: BinaryIO) -> dict[str, str]:
    """The secret variables written by :func:`secrets_on_stdin`, read from ``stream`` up to
    the empty line (or the end); other names are ignored."""
    found: dict[str, str] = {}
    for raw in iter(stream.readline, b""):
        line = raw.decode("ascii", "replace").strip()
        if not line:
            break
        name, _, value = line.partition("=")
        if name in SECRET_VARIABLES:
            found[name] = value
    return found


__all__ = ["ENV_AUTHKEY", "ENV_HUB", "ENV_RUN_ID", "ENV_SECRETS_ON_STDIN", "ENV_TOKEN", "SECRET_VARIABLES",
           "read_secrets", "secrets_on_stdin"]
