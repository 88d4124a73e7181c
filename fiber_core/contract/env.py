"""The environment variables Fiber sets in every job: part of what a backend passes on.

A backend copies ``JobSpec.env`` into the job as it is. Two of these values are
secrets (:data:`SECRET_VARIABLES`): whoever reads them can reach the parent and have
it unpickle what they send, so a backend never logs them or shows them in anything
others can list.
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

SECRET_VARIABLES = frozenset({ENV_AUTHKEY, ENV_TOKEN})
"""The variables of a job's environment that must not be readable by others."""

__all__ = ["ENV_AUTHKEY", "ENV_HUB", "ENV_RUN_ID", "ENV_TOKEN", "SECRET_VARIABLES"]
