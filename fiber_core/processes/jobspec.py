"""What a process's job asks its backend for: its :class:`JobSpec`, from the settings, the
target's ``meta``, the process's own keywords and the program's environment."""

from __future__ import annotations

import os
from collections.abc import Mapping

from fiber_core.contract.env import (
    ENV_AUTHKEY,
    ENV_GROUP,
    ENV_GROUP_INDEX,
    ENV_HUB,
    ENV_PARENT_RUNDIR,
    ENV_RUN_ID,
    ENV_TOKEN,
    JOB_ENV_KEYS,
    program_environment,
)
from fiber_core.runtime.config import config
from fiber_core.runtime.run import runtime

TYPE_CHECKING = False  # typing's own, without importing typing: a job starts without it
if TYPE_CHECKING:
    from typing import Any

    from fiber_core.contract.backend import Backend, JobSpec

RESOURCES = ("cpu", "memory", "gpu", "gpu_type", "capacity")
"""The resources a job may ask for, by setting, ``meta`` or keyword (and ``image``)."""


def job_spec(name: str, meta: Mapping[str, Any], own: Mapping[str, Any], backend: Backend, token: str,
             hub: str, group: tuple[str, int] | None) -> JobSpec:
    """The spec of process ``name``'s job: the settings, overridden by the target's ``meta``,
    overridden by the process's ``own`` keywords; ``token`` and ``hub`` reach it back to this
    process; ``group`` is ``(group id, index)`` for a member of a group start."""
    from fiber_core.contract.backend import (  # a job that starts no process never loads it
        JobSpec,
    )
    from fiber_core.contract.placement import (  # with JobSpec
        Alternative,
        gpu_choices,
        resources_env,
    )

    rt = runtime()
    resources = {k: config.get(k) for k in RESOURCES}
    resources.update({k: v for k, v in meta.items() if v is not None})
    resources.update(own)
    python = config.get("python")
    choices = gpu_choices(resources.get("gpu_type"), resources.get("gpu"))
    passed, secret = program_environment(os.environ, backend.settings,
                                         {k: resources[k] for k in JOB_ENV_KEYS if k in resources},
                                         same_machine=backend.shares_this_machine)
    env = {
        **passed,
        ENV_HUB: hub,
        ENV_TOKEN: token,
        ENV_RUN_ID: rt.run_id,
        ENV_PARENT_RUNDIR: rt.rundir,  # where a job on this machine keeps its files
        ENV_AUTHKEY: rt.authkey.hex(),
        "PYTHONUNBUFFERED": "1",
    }
    if group is not None:  # the token also derives from these (an array job's children)
        env[ENV_GROUP], env[ENV_GROUP_INDEX] = group[0], str(group[1])
    costs = {}
    if config.get("prices"):  # only a program that prices its jobs loads placement here
        from fiber_core.contract.placement import job_costs

        costs = job_costs(choices, resources.get("capacity"), config.get("prices"))
    # What a backend that honours the request gives; one that chooses or ignores it says so.
    if len(choices) <= 1:
        first = choices[0] if choices else None
        env.update(resources_env(first, gpu=resources.get("gpu") or 0,
                                 cost_per_hour=costs.get(Alternative(first, None))))
    return JobSpec(
        command=[*([python] if python else backend.worker_command()), "-m", "fiber_core.processes.worker"],
        name=name,
        image=resources.pop("image", None) or config.get("image"),
        env=env,
        cpu=resources.get("cpu"),
        memory=resources.get("memory"),
        gpu=resources.get("gpu"),
        gpu_type=choices[0].type if choices else None,
        gpu_choices=choices,
        capacity=resources.get("capacity"),
        costs=costs,
        secret_env=secret,
        labels={"fiber.run": rt.run_id, "fiber.parent": str(os.getpid()), "fiber.name": name},
    )
