"""Stable-Baselines3 PPO on CartPole, its environments in Fiber jobs (SubprocVecEnv).

This is a stdlib program with one line changed: ``SubprocVecEnv`` gets
``start_method="fiber"`` instead of ``"spawn"``. SB3 looks that name up with
``multiprocessing.get_context``, where ``import fiber_core`` has added it (the import is
the one line the stdlib version does not need). Each environment then runs in its own job
on the selected backend and talks to the learner through a Fiber ``Pipe``; the policy is
trained here. The default run is short (a smoke test); ``--timesteps 50000`` learns to
balance the pole.

It runs unchanged on any backend; the jobs need stable-baselines3 (and so torch)::

    python examples/sb3_ppo.py
    FIBER_BACKEND=docker python examples/sb3_ppo.py
"""

from __future__ import annotations

import argparse
import time

from stable_baselines3 import PPO
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.vec_env import SubprocVecEnv

import fiber_core  # noqa: F401 - adds the start method "fiber" to multiprocessing.get_context


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, default=2)
    parser.add_argument("--timesteps", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    start = time.perf_counter()
    env = make_vec_env("CartPole-v1", n_envs=args.envs, seed=args.seed, vec_env_cls=SubprocVecEnv,
                       vec_env_kwargs={"start_method": "fiber"})
    try:
        started = time.perf_counter()
        model = PPO("MlpPolicy", env, n_steps=128, batch_size=128, n_epochs=4, seed=args.seed,
                    device="cpu")
        model.learn(total_timesteps=args.timesteps)
        learned = time.perf_counter()
        mean, std = evaluate_policy(model, env, n_eval_episodes=2 * args.envs)
    finally:
        env.close()
    print(f"{args.envs} environments started in {started - start:.2f} s; "
          f"PPO learned {model.num_timesteps} steps in {learned - started:.2f} s; "
          f"mean episode reward {mean:.1f} +/- {std:.1f}")


if __name__ == "__main__":
    main()
