"""Libraries that take a start method *name*, run on Fiber as their users run them.

gymnasium's ``AsyncVectorEnv(context=...)`` and Stable-Baselines3's
``SubprocVecEnv(start_method=...)`` call the stdlib's ``multiprocessing.get_context(name)``;
``import fiber_core`` makes ``"fiber"`` one of those names. The tests build the libraries'
own classes, unpatched, compare what they return with their in-process counterparts
(``SyncVectorEnv``, ``DummyVecEnv``) given the same seeds, train a short PPO, and run the
examples as scripts, on the local backend and on the test Docker daemon.

gymnasium's own test suite is not in its wheel (the installed package has no ``tests``),
so it cannot be run here against Fiber.

gymnasium, numpy and Stable-Baselines3 are imported by the tests that use them: the
start method tests at the top run on every Python of ``scripts/test-pythons.sh``
without them.
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.context
import os
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import fiber_core
from fiber_core.parallel.start_method import register_start_method
from fiber_core.testing import service_missing

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

def make_cartpole() -> Any:
    import gymnasium as gym

    return gym.make("CartPole-v1")


def make_failing_cartpole(fail_at: int) -> Any:
    """CartPole whose ``step`` raises at its ``fail_at``-th call."""
    import gymnasium as gym

    class FailingEnv(gym.Wrapper):
        def __init__(self) -> None:
            super().__init__(gym.make("CartPole-v1"))
            self.steps = 0

        def step(self, action: Any) -> Any:
            self.steps += 1
            if self.steps == fail_at:
                raise ValueError(f"the environment failed at step {self.steps}")
            return self.env.step(action)

    return FailingEnv()


def rollout(envs: Any, steps: int, seed: int) -> Any:
    """Reset with ``seed``, take ``steps`` seeded random actions; every observation."""
    import numpy as np

    obs, _ = envs.reset(seed=seed)
    envs.action_space.seed(seed)
    trace = [obs.copy()]
    for _ in range(steps):
        obs, _, _, _, _ = envs.step(envs.action_space.sample())
        trace.append(obs.copy())
    return np.stack(trace)


# -- the start method name ---------------------------------------------------------------


def test_fiber_is_a_start_method_name_of_the_stdlib() -> None:
    ctx: Any = multiprocessing.get_context("fiber")
    assert ctx is fiber_core.get_context()
    assert ctx.Process is fiber_core.Process
    assert ctx.get_start_method() == "fiber"


def test_registering_changes_nothing_else(run_script: Callable) -> None:
    done = run_script("""
        import multiprocessing
        before = (multiprocessing.get_all_start_methods(), multiprocessing.get_start_method(allow_none=True))
        import fiber_core
        after = (multiprocessing.get_all_start_methods(), multiprocessing.get_start_method(allow_none=True))
        assert before == after, (before, after)
        assert type(multiprocessing.get_context()).__module__ == "multiprocessing.context"
        print(multiprocessing.get_context("fiber").get_start_method())
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "fiber"


def test_stdlib_set_start_method_fiber_is_refused() -> None:
    before = multiprocessing.get_start_method(allow_none=True)
    with pytest.raises(ValueError, match=r"set_start_method\('fiber'\) is not supported.*"
                                         r"import fiber_core as multiprocessing"):
        multiprocessing.set_start_method("fiber", force=True)
    assert multiprocessing.get_start_method(allow_none=True) == before


def test_registration_leaves_a_name_taken_by_another_package(monkeypatch: pytest.MonkeyPatch) -> None:
    table = multiprocessing.context._concrete_contexts  # type: ignore[attr-defined]
    theirs = object()
    monkeypatch.setitem(table, "fiber", theirs)
    assert register_start_method() is False
    assert table["fiber"] is theirs
    monkeypatch.undo()
    assert register_start_method() is True  # again: idempotent
    assert multiprocessing.get_context("fiber") is fiber_core.get_context()


def test_registration_without_the_stdlib_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(multiprocessing.context, "_concrete_contexts")
    assert register_start_method() is False


# -- gymnasium ---------------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("shared_memory", [True, False])
def test_gymnasium_async_vector_env(shared_memory: bool) -> None:
    import gymnasium as gym
    import numpy as np

    sync = gym.vector.SyncVectorEnv([make_cartpole] * 3)
    expected = rollout(sync, 30, seed=42)
    sync.close()

    envs = gym.vector.AsyncVectorEnv([make_cartpole] * 3, shared_memory=shared_memory, context="fiber")
    try:
        assert all(isinstance(p, fiber_core.Process) for p in envs.processes)
        trace = rollout(envs, 30, seed=42)
        assert envs.get_attr("spec")[0].id == "CartPole-v1"
    finally:
        envs.close()
    np.testing.assert_array_equal(trace, expected)
    assert [p.exitcode for p in envs.processes] == [0, 0, 0]


@pytest.mark.timeout(180)
def test_gymnasium_error_in_an_environment_reaches_the_caller() -> None:
    import gymnasium as gym
    import numpy as np

    fns: list[Callable[[], Any]] = [make_cartpole, functools.partial(make_failing_cartpole, 3)]
    envs = gym.vector.AsyncVectorEnv(fns, shared_memory=False, context="fiber")
    try:
        envs.reset(seed=0)
        envs.step(np.array([0, 0]))
        envs.step(np.array([0, 0]))
        with pytest.raises(ValueError, match="failed at step 3"):
            envs.step(np.array([0, 0]))
    finally:
        envs.close(terminate=True)


@pytest.mark.timeout(180)
def test_gymnasium_with_its_module_patched_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback where the name cannot be registered (docs/clients.md): one assignment."""
    import gymnasium.vector.async_vector_env

    monkeypatch.setattr(gymnasium.vector.async_vector_env, "multiprocessing", fiber_core)
    envs = gymnasium.vector.AsyncVectorEnv([make_cartpole] * 2, shared_memory=False)  # context=None
    try:
        assert all(isinstance(p, fiber_core.Process) for p in envs.processes)
        obs, _ = envs.reset(seed=1)
        assert obs.shape == (2, 4)
    finally:
        envs.close()


# -- Stable-Baselines3 ----------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_sb3_subproc_vec_env_steps_as_dummy_vec_env() -> None:
    import numpy as np
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    def trace(vec: Any) -> np.ndarray:
        vec.seed(7)
        vec.action_space.seed(7)
        out = [vec.reset()]
        for _ in range(30):
            obs, _, _, _ = vec.step(np.array([vec.action_space.sample() for _ in range(vec.num_envs)]))
            out.append(obs)
        vec.close()
        return np.stack(out)

    expected = trace(DummyVecEnv([make_cartpole] * 2))
    sub = SubprocVecEnv([make_cartpole] * 2, start_method="fiber")
    assert all(isinstance(p, fiber_core.Process) for p in sub.processes)
    np.testing.assert_array_equal(trace(sub), expected)
    assert [p.exitcode for p in sub.processes] == [0, 0]


@pytest.mark.timeout(300)
def test_sb3_ppo_learns_with_subproc_vec_env() -> None:
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import SubprocVecEnv

    env = SubprocVecEnv([make_cartpole] * 2, start_method="fiber")
    try:
        model = PPO("MlpPolicy", env, n_steps=64, batch_size=64, n_epochs=1, seed=0, device="cpu")
        model.learn(total_timesteps=256)
        assert model.num_timesteps >= 256
        obs: Any = env.reset()
        actions, _ = model.predict(obs, deterministic=True)
        assert actions.shape == (2,)
    finally:
        env.close()


@pytest.mark.timeout(300)
def test_sb3_with_its_module_patched_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback where the name cannot be registered (docs/clients.md): one assignment."""
    from stable_baselines3.common.vec_env import SubprocVecEnv, subproc_vec_env

    monkeypatch.setattr(subproc_vec_env, "mp", fiber_core)
    vec = SubprocVecEnv([make_cartpole] * 2)  # start_method=None: SB3 picks "forkserver"
    try:
        assert all(isinstance(p, fiber_core.Process) for p in vec.processes)
        assert vec.reset().shape == (2, 4)  # type: ignore[union-attr]
    finally:
        vec.close()


# -- the examples, as users run them -----------------------------------------------------------


def docker_env() -> dict[str, str]:
    """The test Docker daemon and image, with this tree and this environment's packages.

    The image has Python and a fiber_core; the jobs run this tree's fiber_core instead (the
    same as the parent's, as the image must have) and find gymnasium, numpy and
    Stable-Baselines3 (with torch) on the mounted path, as in a virtualenv on the host.
    This host's ``/dev/shm`` is mounted too, so that jobs map the parent's shared memory
    (``AsyncVectorEnv(shared_memory=True)``), as the example's documentation says.
    """
    services = Path(os.environ.get("FIBER_SERVICES_DIR", "/tmp/fiber-services"))
    try:
        lines = (services / "docker" / "env").read_text().splitlines()
    except OSError as e:
        service_missing(f"the test Docker daemon is not up ({e}): bash scripts/test-services.sh up docker")
    env = dict(line.split("=", 1) for line in lines if "=" in line)
    site = sysconfig.get_paths()["purelib"]
    env.update(FIBER_BACKEND="docker", FIBER_DOCKER_IMAGE="fiber-test:latest",
               FIBER_DOCKER_VOLUMES=f"{ROOT}:{ROOT}:ro,{site}:{site}:ro,/dev/shm:/dev/shm",
               FIBER_DOCKER_EXTRA_ENV=f"PYTHONPATH={ROOT}")
    return env


def run_example(name: str, args: list[str], backend: str, tmp_path: Path) -> str:
    env = {**os.environ}
    if backend == "docker":
        env.update(docker_env())
    done = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=400)
    assert done.returncode == 0, f"{name} on {backend} failed:\n{done.stdout}\n{done.stderr[-5000:]}"
    return done.stdout


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["local", "docker"])
def test_gym_vector_env_example(backend: str, tmp_path: Path) -> None:
    out = run_example("gym_vector_env.py", ["--envs", "2", "--steps", "20"], backend, tmp_path)
    assert "shared_memory=True: 2 envs" in out and "shared_memory=False: 2 envs" in out
    assert out.count("observations equal SyncVectorEnv's") == 2


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["local", "docker"])
def test_sb3_ppo_example(backend: str, tmp_path: Path) -> None:
    out = run_example("sb3_ppo.py", ["--envs", "2", "--timesteps", "256"], backend, tmp_path)
    assert "PPO learned 256 steps" in out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["local", "docker"])
def test_es_example(backend: str, tmp_path: Path) -> None:
    pytest.importorskip("gymnasium")
    # Each task checks that it reads the weights version its iteration published.
    out = run_example("es.py", ["--iterations", "3", "--population", "8", "--workers", "2",
                                "--noise-mib", "16"], backend, tmp_path)
    assert [line.split()[1] for line in out.splitlines() if line.startswith("iteration")] == ["1", "2", "3"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["local", "docker"])
def test_es_example_with_a_learner_role_runs_each_call_on_its_role(backend: str, tmp_path: Path) -> None:
    """One Pool, two roles: rollouts on the default workers, every update on the learner's
    one worker; the policy learned is the same as with updates in the program."""
    pytest.importorskip("gymnasium")
    args = ["--iterations", "3", "--population", "8", "--workers", "2", "--noise-mib", "16"]
    mixed = run_example("es.py", [*args, "--learner"], backend, tmp_path)
    updates = [line.split()[-1] for line in mixed.splitlines() if "update on" in line]
    assert len(updates) == 3 and len(set(updates)) == 1 and updates[0].startswith("PoolWorker-learner-")
    plain = run_example("es.py", args, backend, tmp_path)

    def scores(out: str) -> list[str]:
        return [line.split("(")[0] for line in out.splitlines() if "mean return" in line]

    assert scores(mixed) == scores(plain) and len(scores(plain)) == 3
