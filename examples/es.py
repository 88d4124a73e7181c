"""Evolution strategies on CartPole with a Pool: the program Fiber is built for.

A linear policy is trained with OpenAI-style ES (antithetic sampling, rank-based
fitness shaping). Perturbations are never shipped: the noise table is published
once with ``fiber_core.broadcast`` (one copy per host, mapped read-only by every
worker there), the policy's weights are published again each iteration, and a
task carries only an offset into the table, so each task is a few bytes each way.

It runs unchanged on any backend::

    python examples/es.py                          # local processes
    FIBER_BACKEND=docker python examples/es.py     # one container per worker

and it is replay-safe (docs/durable.md): its random numbers come from a seeded
generator in the master, none of its decisions from the clock. With a journal, a run
whose master was killed is continued by the same command, and ends with the policy an
uninterrupted run ends with, bit for bit::

    FIBER_JOURNAL=./es-journal python examples/es.py --save policy.npy

With ``--learner``, one Pool has two roles: the rollout workers, and one learner worker
that computes each update (give it a GPU with ``--learner-gpus 1`` on a backend that
has them; the update is where a GPU learner's work would go)::

    python examples/es.py --learner
"""

from __future__ import annotations

import argparse
import os
import time

import gymnasium as gym
import numpy as np

import fiber_core as mp

NOISE_SEED = 123
ENV_ID = "CartPole-v1"

_noise: mp.Broadcast | None = None
_theta: mp.Broadcast | None = None
_env: gym.Env | None = None


def init_worker(noise: mp.Broadcast, theta: mp.Broadcast) -> None:
    """Keep the handles of the noise table and the weights; make the environment."""
    global _noise, _theta, _env
    _noise, _theta = noise, theta
    _env = gym.make(ENV_ID)


def policy_shape() -> tuple[int, int]:
    env = gym.make(ENV_ID)
    shape = (env.action_space.n, env.observation_space.shape[0])
    env.close()
    return shape


def rollout(weights: np.ndarray, episode_seed: int, max_steps: int = 500) -> float:
    assert _env is not None
    obs, _ = _env.reset(seed=episode_seed)
    total = 0.0
    for _ in range(max_steps):
        action = int(np.argmax(weights @ obs))
        obs, reward, terminated, truncated, _ = _env.step(action)
        total += float(reward)
        if terminated or truncated:
            break
    return total


def evaluate(task: tuple[int, int, float, int]) -> tuple[float, float]:
    """Score the antithetic pair theta +/- sigma * noise[offset:offset + n] of one version."""
    version, offset, sigma, episode_seed = task
    assert _noise is not None and _theta is not None
    _log_task()
    theta = _theta.value  # the newest weights: this iteration's
    if _theta.version != version:
        raise RuntimeError(f"weights version {_theta.version} where {version} was published")
    eps = _noise.value[offset:offset + theta.size].reshape(theta.shape)
    return rollout(theta + sigma * eps, episode_seed), rollout(theta - sigma * eps, episode_seed)


def update(theta: np.ndarray, shaped: np.ndarray, offsets: np.ndarray, lr: float,
           sigma: float) -> tuple[np.ndarray, str]:
    """One ES step from the shaped returns, on the learner's worker; and where it ran."""
    assert _noise is not None
    grad = np.zeros_like(theta)
    for (plus, minus), o in zip(shaped, offsets):
        grad += (plus - minus) * _noise.value[o:o + theta.size].reshape(theta.shape)
    return theta + lr / (2 * len(offsets) * sigma) * grad, mp.current_process().name


def _log_task() -> None:
    """With ``--task-log``: one line per task run, ``call item`` (its identity), to count work."""
    path = os.environ.get("ES_TASK_LOG")
    task = mp.current_task()
    if path and task is not None:
        with open(path, "a") as f:
            f.write(f"{task.call} {task.item}\n")


def centered_ranks(x: np.ndarray) -> np.ndarray:
    ranks = np.empty(x.size, dtype=np.float32)
    ranks[x.ravel().argsort()] = np.arange(x.size, dtype=np.float32)
    return (ranks / (x.size - 1) - 0.5).reshape(x.shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--population", type=int, default=64, help="antithetic pairs per iteration")
    parser.add_argument("--workers", type=int, default=None, help="pool size (default: cpu_count)")
    parser.add_argument("--sigma", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--noise-mib", type=int, default=64, help="size of the noise table")
    parser.add_argument("--learner", action="store_true", help="updates on a learner worker of its own")
    parser.add_argument("--learner-gpus", type=int, default=0, help="GPUs of the learner worker")
    parser.add_argument("--save", help="write the final policy's weights here (numpy .npy)")
    parser.add_argument("--task-log", help="append each task's identity (call, item) to this file")
    args = parser.parse_args()
    learner = {"processes": 1, **({"gpu": args.learner_gpus} if args.learner_gpus else {})}
    if args.task_log:
        os.environ["ES_TASK_LOG"] = os.path.abspath(args.task_log)  # the workers inherit it

    shape = policy_shape()
    theta = np.zeros(shape, dtype=np.float32)
    rng = np.random.default_rng(0)
    size = args.noise_mib * 2**20 // 4
    noise = np.random.default_rng(NOISE_SEED).standard_normal(size, dtype=np.float32)
    noise_handle, theta_handle = mp.broadcast(noise), mp.broadcast(theta.copy())
    with mp.Pool(args.workers, initializer=init_worker, initargs=(noise_handle, theta_handle),
                 roles={"learner": learner} if args.learner else None) as pool:
        for it in range(1, args.iterations + 1):
            start = time.perf_counter()
            version = theta_handle.version
            offsets = rng.integers(0, size - theta.size, size=args.population)
            seed = int(rng.integers(2**31))
            tasks = [(version, int(o), args.sigma, seed) for o in offsets]
            returns = np.array(pool.map(evaluate, tasks), dtype=np.float32)
            shaped = centered_ranks(returns)
            if args.learner:
                theta, where = pool.apply(update, (theta, shaped, offsets, args.lr, args.sigma),
                                          role="learner")
                print(f"iteration {it:3d}  update on {where}", flush=True)
            else:
                grad = np.zeros_like(theta)
                for (plus, minus), o in zip(shaped, offsets):
                    grad += (plus - minus) * noise[o:o + theta.size].reshape(shape)
                theta += args.lr / (2 * args.population * args.sigma) * grad
            theta_handle.publish(theta)
            score = pool.apply(rollout_with, (theta, 10_000 + it))
            print(f"iteration {it:3d}  mean return {returns.mean():7.1f}  max {returns.max():6.1f}  "
                  f"policy return {score:6.1f}  ({time.perf_counter() - start:.2f}s)", flush=True)
    if args.save:
        np.save(args.save, theta)


def rollout_with(weights: np.ndarray, episode_seed: int) -> float:
    _log_task()
    return rollout(weights, episode_seed)


if __name__ == "__main__":
    main()
