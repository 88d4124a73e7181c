"""The container of a job as fiber_docker.spec builds it: pure, no daemon."""

from __future__ import annotations

import pytest
from fiber_core.contract import BackendError, JobSpec

from fiber_docker.spec import (
    LABEL_OWNER,
    LABEL_RUN,
    SECRETS_SHELL,
    command_and_stdin,
    container_labels,
    container_name,
    device_requests,
    limits,
    mounts,
)


def test_gpus_become_device_requests_a_count_or_every_gpu() -> None:
    assert device_requests(None) is None and device_requests(0) is None
    assert device_requests(2) == [{"count": 2, "capabilities": [["gpu"]]}]
    assert device_requests(-1) == [{"count": -1, "capabilities": [["gpu"]]}]  # every GPU


def test_limits_are_nano_cpus_bytes_and_gpus() -> None:
    assert limits(JobSpec(command=[], cpu=0.5, memory=512, gpu=1)) == {
        "nano_cpus": 500_000_000, "mem_limit": 512 * 1024 * 1024,
        "device_requests": [{"count": 1, "capabilities": [["gpu"]]}]}
    assert limits(JobSpec(command=[])) == {"nano_cpus": None, "mem_limit": None, "device_requests": None}


def test_a_container_name_keeps_only_what_docker_allows() -> None:
    name = container_name("r1", "ab12", 3, "Process-1:2 weird/name")
    assert name == "fiber-r1-ab12-3-Process-1-2-weird-name"
    assert container_name("r1", "ab12", 3, "../..") == "fiber-r1-ab12-3-job"
    assert len(container_name("r1", "ab12", 3, "x" * 500)) == 120


def test_labels_find_the_run_and_the_backend_instance_again() -> None:
    labels = container_labels(JobSpec(command=[], labels={"fiber.name": "p", LABEL_RUN: "other"}), "r1", "docker", "o1")
    assert labels == {"fiber.name": "p", LABEL_RUN: "r1", "fiber.backend": "docker", LABEL_OWNER: "o1"}


def test_the_secrets_travel_on_stdin_not_in_the_containers_config() -> None:
    env = {"A": "1", "FIBER_AUTHKEY": "k", "FIBER_PROCESS_TOKEN": "t"}
    command, public, stdin = command_and_stdin(["python3", "-m", "w"], env)
    assert command == ["/bin/sh", "-c", SECRETS_SHELL, "fiber-job", "python3", "-m", "w"]
    assert public == {"A": "1"} and stdin == b"FIBER_AUTHKEY=k\nFIBER_PROCESS_TOKEN=t\n\n"
    assert command_and_stdin(["true"], {"A": "1"}) == (["true"], {"A": "1"}, b"")


def test_variables_marked_secret_travel_on_stdin_with_the_key() -> None:
    env = {"FIBER_AUTHKEY": "k", "WANDB_API_KEY": "w", "OMP_NUM_THREADS": "4"}
    command, public, stdin = command_and_stdin(["true"], env, ("WANDB_API_KEY",))
    assert public == {"OMP_NUM_THREADS": "4"} and stdin == b"FIBER_AUTHKEY=k\nWANDB_API_KEY=w\n\n"
    with pytest.raises(BackendError, match="WANDB_API_KEY holds a line break"):
        command_and_stdin(["true"], {**env, "WANDB_API_KEY": "a\nb"}, ("WANDB_API_KEY",))


def test_the_working_directory_is_mounted_unless_this_process_runs_in_a_container() -> None:
    spec = JobSpec(command=[], volumes={"data": "/data"})
    settings = {"mount_cwd": None, "volumes": ["/srv:/srv:ro"]}
    assert mounts(spec, settings, "/home/me/app", False) == (
        ["/home/me/app:/home/me/app", "/srv:/srv:ro", "data:/data"], "/home/me/app")
    assert mounts(spec, settings, "/home/me/app", True) == (["/srv:/srv:ro", "data:/data"], None)
    assert mounts(spec, {"mount_cwd": True}, "/", False) == (["data:/data"], None)  # never the root
    with pytest.raises(BackendError, match="SOURCE:TARGET"):
        mounts(spec, {"volumes": ["nocolon"]}, "/", False)
