"""The Batch job of a Fiber job as fiber_aws.spec builds it: pure, no AWS."""

from __future__ import annotations

import pytest
from fiber_core.contract import BackendError, ConfigError, JobSpec

from fiber_aws.spec import (
    capacity_queue,
    choice_spec,
    command,
    group_spec,
    job_name,
    parse_gpu_queues,
    queue_for,
    queue_lists,
    refuse_credentials,
    resources,
    tags,
    volumes,
)

GPU_QUEUES = parse_gpu_queues(["A10G:gpu-a10g", "v100:gpu-v100"])


def test_a_job_goes_to_the_queue_of_its_hardware() -> None:
    assert GPU_QUEUES == {"a10g": "gpu-a10g", "v100": "gpu-v100"}
    assert queue_for(JobSpec(command=[]), "cpu", GPU_QUEUES) == ("cpu", 0)
    assert queue_for(JobSpec(command=[], gpu=2, gpu_type="V100"), "cpu", GPU_QUEUES) == ("gpu-v100", 2)
    assert queue_for(JobSpec(command=[], gpu_type="a10g"), None, GPU_QUEUES) == ("gpu-a10g", 1)  # a type: one GPU
    assert queue_for(JobSpec(command=[], gpu=1), None, {"t4": "gpu-t4"}) == ("gpu-t4", 1)  # the only GPU queue
    for spec, says in [(JobSpec(command=[]), "no job queue for CPU jobs"),
                       (JobSpec(command=[], gpu=1), "without a GPU type"),
                       (JobSpec(command=[], gpu=1, gpu_type="h100"), "no job queue for GPU type 'h100'"),
                       (JobSpec(command=[], gpu=-1), "AWS Batch needs a count")]:
        with pytest.raises(BackendError, match=says):
            queue_for(spec, None, GPU_QUEUES)
    with pytest.raises(ConfigError, match="GPU_TYPE:QUEUE"):
        parse_gpu_queues(["nocolon"])


def test_each_gpu_alternative_goes_to_its_own_queue() -> None:
    spec = JobSpec(command=[], gpu_type=["a10g", ("v100", 4)])  # type: ignore[arg-type]
    assert queue_for(choice_spec(spec, 0), None, GPU_QUEUES) == ("gpu-a10g", 1)
    assert queue_for(choice_spec(spec, 1), None, GPU_QUEUES) == ("gpu-v100", 4)
    spot_first = JobSpec(command=[], capacity="spot-then-on-demand")
    assert [choice_spec(spot_first, i).capacity for i in range(2)] == ["spot", "on-demand"]


def test_a_type_listed_again_names_more_queues_and_a_capacity_kind_picks_among_them() -> None:
    lists = queue_lists("cpu-od, cpu-spot", ["a10g:a-od", "A10G:a-spot", "v100:v"])
    assert lists == {None: ["cpu-od", "cpu-spot"], "a10g": ["a-od", "a-spot"], "v100": ["v"]}
    assert parse_gpu_queues(["a10g:a-od", "a10g:a-spot"]) == {"a10g": "a-od"}  # the first is the default
    kinds = {"a-od": "on-demand", "a-spot": "spot"}
    assert capacity_queue("spot", lists["a10g"], kinds, "x") == "a-spot"
    assert capacity_queue("on-demand", lists["a10g"], kinds, "x") == "a-od"
    with pytest.raises(BackendError, match=r"no job queue of spot capacity for w: its queues are v \(on-demand\)"):
        capacity_queue("spot", ["v"], {"v": "on-demand"}, "w")


def test_resources_volumes_and_the_working_directory() -> None:
    assert resources(2, 512, 1) == [{"type": "VCPU", "value": "2"}, {"type": "MEMORY", "value": "512"},
                                    {"type": "GPU", "value": "1"}]
    assert volumes({"/data": "/mnt"}) == {"volumes": [{"name": "v0", "host": {"sourcePath": "/data"}}],
                                          "mountPoints": [{"sourceVolume": "v0", "containerPath": "/mnt",
                                                           "readOnly": False}]}
    with pytest.raises(BackendError, match="host paths only"):
        volumes({"named": "/mnt"})
    assert command(JobSpec(command=["python3"], cwd="/w")) == ["/bin/sh", "-c", 'cd "$0" && exec "$@"', "/w", "python3"]
    assert command(JobSpec(command=["python3"])) == ["python3"]


def test_names_and_tags_keep_to_what_batch_allows() -> None:
    assert job_name("run.1/x", 3, "Process-1:2 w") == "fiber-run1x-3-Process-1-2-w"
    assert len(job_name("r", 1, "x" * 300)) == 128
    assert tags(JobSpec(command=[], labels={"fiber.name": "a|b"}), "r1") == {"fiber.name": "a_b", "fiber.run": "r1"}


def test_a_group_of_like_members_is_one_array_job() -> None:
    def member(i: int) -> JobSpec:
        return JobSpec(command=["python3"], name=f"w{i}", env={"FIBER_GROUP": "g", "FIBER_GROUP_INDEX": str(i),
                                                                "A": "1"}, labels={"fiber.name": f"w{i}"})

    common = group_spec([member(0), member(1)])
    assert common is not None and common.env == {"FIBER_GROUP": "g", "A": "1"}
    assert common.command[-1] == "python3" and "AWS_BATCH_JOB_ARRAY_INDEX" in common.command[2]
    unlike = member(1)
    unlike.env["A"] = "2"
    assert group_spec([member(0), unlike]) is None


def test_credentials_in_the_configuration_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    refuse_credentials({"queue": "q"}, {"queue"})
    with pytest.raises(ConfigError, match="AWS_SECRET_ACCESS_KEY in \\[aws\\] extra_env"):
        refuse_credentials({"extra_env": ["AWS_SECRET_ACCESS_KEY=x"]}, {"extra_env"})
    with pytest.raises(ConfigError, match="an access key id in setting 'queue'"):
        refuse_credentials({"queue": "AKIAABCDEFGHIJKLMNOP"}, {"queue"})
    monkeypatch.setenv("FIBER_AWS_SECRET_KEY", "x")
    with pytest.raises(ConfigError, match="environment variable FIBER_AWS_SECRET_KEY"):
        refuse_credentials({}, set())
