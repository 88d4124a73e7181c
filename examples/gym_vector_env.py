"""gymnasium's AsyncVectorEnv with every environment in a Fiber job.

This is a stdlib program with one line changed: the ``context`` given to
``AsyncVectorEnv`` is ``"fiber"`` instead of ``"spawn"``. gymnasium looks that name up
with ``multiprocessing.get_context``, where ``import fiber_core`` has added it (the import
is the one line the stdlib version does not need). Each CartPole then runs in its own
job on the selected backend, and the observations come back through shared memory
(``shared_memory=True``: a Fiber ``Array``) or through the pipes (``False``). Each run
is compared with a ``SyncVectorEnv`` given the same seeds and actions.

It runs unchanged on any backend; the jobs need gymnasium (and numpy). With
``shared_memory=True`` they must also map this process's shared memory: they do on the
local backend, and in Docker containers on this host when ``/dev/shm`` is mounted; jobs on
other machines cannot, and the run says so (``--shared-memory off`` leaves it out)::

    python examples/gym_vector_env.py
    FIBER_BACKEND=docker FIBER_DOCKER_VOLUMES=/dev/shm:/dev/shm python examples/gym_vector_env.py
    FIBER_BACKEND=kubernetes python examples/gym_vector_env.py --shared-memory off
"""

from __future__ import annotations

import argparse
import functools
import time

import gymnasium as gym
import numpy as np

import fiber_core  # noqa: F401 - adds the start method "fiber" to multiprocessing.get_context


def rollout(envs: gym.vector.VectorEnv, steps: int, seed: int) -> np.ndarray:
    """Reset with ``seed``, take ``steps`` seeded random actions; every observation."""
    obs, _ = envs.reset(seed=seed)
    envs.action_space.seed(seed)
    trace = [obs.copy()]
    for _ in range(steps):
        obs, _, _, _, _ = envs.step(envs.action_space.sample())
        trace.append(obs.copy())
    return np.stack(trace)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shared-memory", choices=("both", "on", "off"), default="both")
    args = parser.parse_args()
    modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.shared_memory]
    make = [functools.partial(gym.make, "CartPole-v1")] * args.envs

    sync = gym.vector.SyncVectorEnv(make)
    expected = rollout(sync, args.steps, args.seed)
    sync.close()

    for shared_memory in modes:
        start = time.perf_counter()
        envs = gym.vector.AsyncVectorEnv(make, shared_memory=shared_memory, context="fiber")
        try:
            started = time.perf_counter()
            trace = rollout(envs, args.steps, args.seed)
            stepped = time.perf_counter()
        finally:
            envs.close()
        same = np.array_equal(trace, expected)
        print(f"shared_memory={shared_memory}: {args.envs} envs started in {started - start:.2f} s, "
              f"{args.steps} steps at {args.envs * args.steps / (stepped - started):.0f} env steps/s; "
              f"observations {'equal' if same else 'DIFFERENT from'} SyncVectorEnv's")
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
