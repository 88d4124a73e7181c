"""The program's environment as a job on another machine gets it: the pure decision
(``contract/env.py``) and the checks of what a user gives."""

from __future__ import annotations

import pytest

import fiber_core
from fiber_core.base.errors import ConfigError
from fiber_core.contract import ENV_OPTIONS, Backend, JobSpec, split_secrets
from fiber_core.contract.env import (
    ENV_AUTHKEY,
    ENV_TOKEN,
    check_env_settings,
    check_job_env,
    denied,
    program_environment,
)

PROGRAM = {
    "PATH": "/usr/bin", "HOME": "/home/me", "TERM": "xterm", "SSH_AUTH_SOCK": "/tmp/agent", "XDG_RUNTIME_DIR": "/run",
    "KUBERNETES_SERVICE_HOST": "10.0.0.1", "AWS_SECRET_ACCESS_KEY": "aws", "AWS_BATCH_JOB_ID": "j",
    "ECS_CONTAINER_METADATA_URI": "http://x", ENV_AUTHKEY: "key", ENV_TOKEN: "tok", "BASH_FUNC_f%%": "() { :; }",
    "OMP_NUM_THREADS": "4", "PYTHONHASHSEED": "0", "MY_SETTING": "on", "MY_DEBUG": "1", "WANDB_API_KEY": "w",
}


def test_the_program_environment_passes_less_what_describes_this_machine() -> None:
    env, secret = program_environment(PROGRAM, {})
    assert env == {"OMP_NUM_THREADS": "4", "PYTHONHASHSEED": "0", "MY_SETTING": "on", "MY_DEBUG": "1",
                   "WANDB_API_KEY": "w"}
    assert secret == ()


@pytest.mark.parametrize("name", ["PATH", "HOME", "HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "DISPLAY", "TERM",
                                  "SSH_CONNECTION", "XDG_SESSION_ID", "DBUS_SESSION_BUS_ADDRESS",
                                  "KUBERNETES_PORT", "AWS_BATCH_JOB_ARRAY_INDEX", "ECS_AGENT_URI",
                                  "FIBER_AUTHKEY", "FIBER_PROCESS_TOKEN", "FIBER_PARENT_PID", "BASH_FUNC_x%%"])
def test_each_name_of_the_deny_list_stays_behind(name: str) -> None:
    assert denied(name)


def test_settings_exclude_add_and_mark_secrets_and_the_job_wins() -> None:
    settings = {"env_pass": True, "env_exclude": ["MY_D*"], "extra_env": ["OMP_NUM_THREADS=1", "ADDED=a"],
                "secret_env": ["WANDB_API_KEY"]}
    env, secret = program_environment(PROGRAM, settings)
    assert env == {"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "MY_SETTING": "on", "ADDED": "a",
                   "WANDB_API_KEY": "w"}
    assert secret == ("WANDB_API_KEY",)
    job = check_job_env({"env": {"OMP_NUM_THREADS": "8"}, "env_exclude": ["MY_SETTING"]}, "meta")
    env, _ = program_environment(PROGRAM, settings, job)
    assert env["OMP_NUM_THREADS"] == "8" and "MY_SETTING" not in env and env["ADDED"] == "a"


def test_pass_nothing_still_gives_what_is_added_and_marked_even_a_denied_name() -> None:
    job = check_job_env({"env_pass": False, "env": {"ONLY": "1"}, "secret_env": ["AWS_SECRET_ACCESS_KEY"]}, "meta")
    env, secret = program_environment(PROGRAM, {"env_pass": True}, job)
    assert env == {"ONLY": "1", "AWS_SECRET_ACCESS_KEY": "aws"}
    assert secret == ("AWS_SECRET_ACCESS_KEY",)
    env, _ = program_environment(PROGRAM, {"env_pass": False}, check_job_env({"env_pass": True}, "meta"))
    assert "OMP_NUM_THREADS" in env  # the job's choice wins over the backend's


def test_a_secret_not_set_anywhere_is_not_invented() -> None:
    env, secret = program_environment(PROGRAM, {"secret_env": ["HF_TOKEN"]})
    assert "HF_TOKEN" not in env and secret == ()


def test_a_job_on_this_machine_gets_only_what_is_added_or_marked() -> None:
    env, secret = program_environment(PROGRAM, {"extra_env": ["A=1"], "secret_env": ["WANDB_API_KEY"]},
                                      same_machine=True)
    assert env == {"A": "1", "WANDB_API_KEY": "w"} and secret == ("WANDB_API_KEY",)


@pytest.mark.parametrize("choices, says", [
    ({"env": {"A": 1}}, "the value of A is int"),
    ({"env": {"1A": "x"}}, "'1A' is not a variable name"),
    ({"env": {"A=B": "x"}}, "is not a variable name"),
    ({"env": {"A": "x\0y"}}, "NUL"),
    ({"env": ["A=1"]}, "expected a mapping"),
    ({"env": {"FIBER_AUTHKEY": "x"}}, "Fiber's own variable"),
    ({"env_pass": "no"}, "expected True or False"),
    ({"env_exclude": [3]}, "not a variable name or pattern"),
    ({"env_exclude": ["A B"]}, "not a variable name or pattern"),
    ({"secret_env": ["WANDB API"]}, "is not a variable name"),
    ({"secret_env": 5}, "expected variable names"),
    ({"envs": {}}, "unknown environment choice 'envs'"),
])
def test_bad_choices_fail_at_once_saying_what_is_wrong(choices: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        check_job_env(choices, "meta")


def test_meta_and_process_check_their_choices_when_given() -> None:
    with pytest.raises(ValueError, match=r"meta\(env=...\): the value of N is int"):
        fiber_core.meta(env={"N": 4})
    with pytest.raises(ValueError, match=r"Process\(secret_env=...\)"):
        fiber_core.Process(target=print, secret_env=["not a name"])

    @fiber_core.meta(env={"N": "4"}, secret_env="TOKEN_X")
    def f() -> None: ...

    assert f.__fiber_meta__["env"] == {"N": "4"} and f.__fiber_meta__["secret_env"] == ("TOKEN_X",)


class _Env(Backend):
    name = "envtest"
    options = ENV_OPTIONS

    def create_job(self, spec: JobSpec):  # pragma: no cover - never started
        raise NotImplementedError

    def terminate_job(self, job) -> None:  # pragma: no cover
        raise NotImplementedError


@pytest.mark.parametrize("settings, says", [
    ({"extra_env": ["BAD NAME=1"]}, r"extra_env in \[envtest\]: 'BAD NAME'"),
    ({"secret_env": ["FIBER_PROCESS_TOKEN"]}, r"secret_env in \[envtest\]: FIBER_PROCESS_TOKEN is Fiber's own"),
    ({"env_exclude": ["A;B"]}, r"env_exclude in \[envtest\]"),
])
def test_a_backend_with_bad_environment_settings_is_not_made(settings: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        _Env(settings)
    check_env_settings({"extra_env": ["GOOD=1"], "secret_env": ["WANDB_API_KEY"], "env_exclude": ["MY_*"]}, "x")


def test_marked_names_are_split_out_with_the_run_secrets() -> None:
    public, secret = split_secrets({ENV_AUTHKEY: "k", "WANDB_API_KEY": "w", "A": "1"}, ("WANDB_API_KEY",))
    assert public == {"A": "1"} and secret == {ENV_AUTHKEY: "k", "WANDB_API_KEY": "w"}


def _report(q, names) -> None:  # noqa: ANN001
    import os

    q.put({n: os.environ.get(n) for n in names})


def test_a_local_job_inherits_the_environment_whole_and_gets_what_a_job_adds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FIBERTEST_LOCAL", "set in the program")
    monkeypatch.setenv("TERM", "fibertest-term")  # the same machine: nothing is denied
    q = fiber_core.Queue()
    p = fiber_core.Process(target=_report, args=(q, ["FIBERTEST_LOCAL", "TERM", "FIBERTEST_ADDED"]),
                           env={"FIBERTEST_ADDED": "added"})
    p.start()
    assert q.get(timeout=60) == {"FIBERTEST_LOCAL": "set in the program", "TERM": "fibertest-term",
                                 "FIBERTEST_ADDED": "added"}
    p.join(60)
    assert p.exitcode == 0
