"""gymnasium's AsyncVectorEnv stepping CartPoles: Fiber's start method against the stdlib's.

    python benchmarks/gym_vector.py [--envs 8] [--steps 1000] [--reps 5] [--stdlib spawn]

The same program, ``AsyncVectorEnv(..., context=name)``, with ``name`` ``"fiber"`` (every
environment a job on the configured backend, ``FIBER_BACKEND``, default ``local``) and a
stdlib start method (``spawn`` by default), in both observation modes: ``shared_memory=True``
(observations written to a shared ``Array``) and ``False`` (sent through the pipes).
Each repetition builds a vector env per case, resets it, takes ``--warmup`` steps, then
times ``--steps`` steps with pre-drawn random actions, and closes it; the cases run
interleaved, the order reversed every repetition. Reported: medians over repetitions of the
environment steps per second (``envs * steps / time``) and of the start time (constructor to
first reset done), and fiber / stdlib ratios of the step rates (``>= 1.00``: Fiber is at
least as fast). A case that fails is reported with its error, and the others still run.
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import sys
import time

import gymnasium as gym
import numpy as np

import fiber_core  # noqa: F401 - adds the start method "fiber" to multiprocessing.get_context


def measure(context: str, shared_memory: bool, envs: int, warmup: int, steps: int,
            actions: np.ndarray) -> tuple[float, float]:
    """(seconds to start and reset, environment steps per second) of one vector env."""
    start = time.perf_counter()
    vec = gym.vector.AsyncVectorEnv([functools.partial(gym.make, "CartPole-v1")] * envs,
                                    shared_memory=shared_memory, context=context)
    try:
        vec.reset(seed=0)
        started = time.perf_counter() - start
        for i in range(warmup):
            vec.step(actions[i])
        t0 = time.perf_counter()
        for i in range(steps):
            vec.step(actions[warmup + i])
        elapsed = time.perf_counter() - t0
    finally:
        vec.close()
    return started, envs * steps / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--stdlib", default="spawn", help="the stdlib start method compared")
    args = parser.parse_args()

    actions = np.random.default_rng(0).integers(0, 2, size=(args.warmup + args.steps, args.envs))
    cases = [(ctx, shm) for shm in (True, False) for ctx in ("fiber", args.stdlib)]
    starts: dict[tuple[str, bool], list[float]] = {c: [] for c in cases}
    rates: dict[tuple[str, bool], list[float]] = {c: [] for c in cases}
    failed: dict[tuple[str, bool], str] = {}
    for rep in range(args.reps):
        for case in cases if rep % 2 == 0 else reversed(cases):
            if case in failed:
                continue
            try:
                started, rate = measure(case[0], case[1], args.envs, args.warmup, args.steps, actions)
            except Exception as e:
                failed[case] = f"{type(e).__name__}: {e}"
                continue
            starts[case].append(started)
            rates[case].append(rate)

    print(f"# {platform.python_implementation()} {platform.python_version()}, {platform.machine()}, "
          f"backend {fiber_core.config.get('backend') or 'local'}; {args.envs} CartPole-v1 envs, "
          f"{args.steps} steps, medians of {args.reps} interleaved repetitions")
    print(f"{'shared_memory':>13} {'context':>8} {'start s':>8} {'env steps/s':>12} {'fiber/stdlib':>13}")
    for ctx, shm in cases:
        if (ctx, shm) in failed:
            print(f"{shm!s:>13} {ctx:>8}  failed: {failed[ctx, shm]}")
            continue
        rate = statistics.median(rates[ctx, shm])
        ratio = ""
        if ctx == "fiber" and rates[args.stdlib, shm]:
            ratio = f"{rate / statistics.median(rates[args.stdlib, shm]):.2f}"
        print(f"{shm!s:>13} {ctx:>8} {statistics.median(starts[ctx, shm]):8.2f} {rate:12.0f} {ratio:>13}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
