"""GPU alternatives in order of preference (``gpu_choices``), the refusal of backends that do not
try them, and what a job got (``current_process().resources``) on the local backend."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest
from conftest import T

import fiber_core as mp
from fiber_core.backends.local import LocalBackend
from fiber_core.base.errors import BackendError, ConfigError
from fiber_core.contract import (
    ENV_NODE,
    ENV_RESOURCES,
    RESOURCE_KEYS,
    Alternative,
    GpuChoice,
    JobSpec,
    capacity_kinds,
    gpu_choices,
    job_resources,
    resources_env,
    waiting_verdict,
)


@pytest.mark.parametrize(("gpu_type", "gpu", "expected"), [
    (None, None, ()),
    ("a100", None, (GpuChoice("a100", 1),)),
    ("a100", 4, (GpuChoice("a100", 4),)),
    ("a100", -1, (GpuChoice("a100", -1),)),  # every GPU of a node, as with one type
    (["a100", "l40s"], 2, (GpuChoice("a100", 2), GpuChoice("l40s", 2))),
    ([("a100", 1), ("l4", 2)], None, (GpuChoice("a100", 1), GpuChoice("l4", 2))),
    (["a100", ("l4", 2)], None, (GpuChoice("a100", 1), GpuChoice("l4", 2))),
    (("l4", 2), None, (GpuChoice("l4", 2),)),  # one pair is one alternative
    ("a100, l4:2", None, (GpuChoice("a100", 1), GpuChoice("l4", 2))),  # as settings write it
    (" a10g ", None, (GpuChoice("a10g", 1),)),
])
def test_every_form_of_gpu_type_becomes_the_alternatives_in_order(gpu_type: Any, gpu: int | None,
                                                                  expected: tuple[GpuChoice, ...]) -> None:
    assert gpu_choices(gpu_type, gpu) == expected


@pytest.mark.parametrize(("gpu_type", "message"), [
    ([], "an empty list of GPU types"),
    (["a100", ("l4", 0)], "a count is at least 1"),
    ([("l4", -2)], "a count is at least 1"),
    ([("l4", True)], "give a whole number of GPUs"),
    ([("l4", 1.5)], "give a whole number of GPUs"),
    (["a100", 7], "7 is not a GPU type"),
    ([None], "None is not a GPU type"),
    (42, "expected a GPU type"),
    (["a100", "A100"], "'A100' is listed twice"),
    ("a100,,l4", "an empty entry between commas"),
    ("a100:x", "is not TYPE or TYPE:COUNT"),
    (["  "], "an empty GPU type name"),
])
def test_bad_gpu_types_fail_at_once_saying_what_is_wrong(gpu_type: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        gpu_choices(gpu_type)


def test_a_job_spec_holds_the_alternatives_and_its_first_choice() -> None:
    spec = JobSpec(command=[], gpu_type=["a100", ("l4", 2)])  # type: ignore[arg-type]
    assert spec.gpu_choices == (GpuChoice("a100", 1), GpuChoice("l4", 2))
    assert (spec.gpu_type, spec.gpu) == ("a100", 1)
    one = JobSpec(command=[], gpu_type="l4:2")
    assert (one.gpu_type, one.gpu, one.gpu_choices) == ("l4", 2, (GpuChoice("l4", 2),))
    plain = JobSpec(command=[], gpu=2, gpu_type="a10g")  # as before: fields untouched
    assert (plain.gpu_type, plain.gpu, plain.gpu_choices) == ("a10g", 2, (GpuChoice("a10g", 2),))
    assert JobSpec(command=[]).gpu_choices == ()


class _OneTypeOnly(LocalBackend):
    name = "one-type-only"
    gpu_alternatives = False
    capacity_kinds = False


def test_a_backend_that_does_not_try_alternatives_refuses_several_instead_of_taking_the_first() -> None:
    b = _OneTypeOnly()
    try:
        with pytest.raises(BackendError, match=r"cannot try GPU types in order \(w asks for a100:1, l4:2\)"):
            b.start_job(JobSpec(command=["true"], name="w", gpu_type=["a100", ("l4", 2)]))  # type: ignore[arg-type]
        with pytest.raises(BackendError, match="cannot try GPU types in order"):
            b.start_jobs([JobSpec(command=["true"], name="w", gpu_type="a100,l4")] * 2)
        assert b.jobs == []
    finally:
        b.cleanup()


def test_meta_process_and_pool_refuse_a_malformed_list_before_any_job_starts() -> None:
    with pytest.raises(ConfigError, match="an empty list"):
        mp.meta(gpu_type=[])
    with pytest.raises(ConfigError, match="listed twice"):
        mp.Process(target=print, gpu_type=["l4", "l4"])
    with pytest.raises(ConfigError, match="a count is at least 1"):
        mp.Pool(1, gpu_type=[("a100", 0)])

    @mp.meta(gpu_type=["a100", ("l4", 2)])
    def learner() -> None:
        pass

    assert learner.__fiber_meta__["gpu_type"] == ["a100", ("l4", 2)]  # type: ignore[attr-defined]


def test_resources_read_what_the_backend_wrote_and_fill_the_host() -> None:
    env = resources_env(GpuChoice("l4", 2), capacity="spot", cost_per_hour=1.5)
    assert job_resources(env) == {"gpu_type": "l4", "gpu": 2, "capacity": "spot", "cost_per_hour": 1.5,
                                  "host": socket.gethostname()}
    assert job_resources({**env, ENV_NODE: "node-7"})["host"] == "node-7"
    assert job_resources(resources_env(None, host="h1"))["host"] == "h1"
    none = job_resources({})
    assert set(none) == set(RESOURCE_KEYS)
    assert (none["gpu_type"], none["gpu"], none["capacity"], none["cost_per_hour"]) == (None, 0, None, None)
    assert job_resources({ENV_RESOURCES: "not json"})["gpu"] == 0  # a damaged record: nothing known


def _put_resources(q: Any) -> None:
    q.put(json.dumps(mp.current_process().resources))


def test_a_local_job_knows_it_got_no_gpu_whatever_it_asked() -> None:
    q = mp.Queue()
    p = mp.Process(target=_put_resources, args=(q,), gpu_type=["a100", "l4"])
    p.start()
    got = json.loads(q.get(timeout=T))
    p.join(T)
    assert p.exitcode == 0
    assert got == {"gpu_type": None, "gpu": 0, "capacity": None, "cost_per_hour": None,
                   "host": socket.gethostname()}
    with pytest.raises(ValueError, match="known inside it"):
        _ = p.resources
    assert mp.current_process().resources["gpu"] == 0


@pytest.mark.parametrize(("choice", "choices", "waited", "verdict"), [
    (0, 3, 5.0, "wait"),     # within fallback_wait
    (0, 3, 11.0, "next"),
    (1, 3, 11.0, "next"),
    (2, 3, 11.0, "wait"),    # the last waits the backend's own timeout...
    (2, 3, 31.0, "fail"),    # ...and fails after it
    (0, 1, 31.0, "fail"),    # one type: as before alternatives existed
    (0, 0, 31.0, "fail"),    # no GPU type
])
def test_a_waiting_job_moves_on_after_the_fallback_wait_and_the_last_fails_after_the_timeout(
        choice: int, choices: int, waited: float, verdict: str) -> None:
    assert waiting_verdict(choice, choices, waited, fallback_wait=10.0, timeout=30.0) == verdict
    assert waiting_verdict(choices - 1, choices, 1e9, fallback_wait=10.0, timeout=0.0) in ("wait", "next")


def test_the_spec_of_one_alternative_asks_for_it_alone_and_tells_the_job() -> None:
    spec = JobSpec(command=[], env={"A": "1"}, gpu_type=["a100", ("l4", 2)])  # type: ignore[arg-type]
    l4 = spec.choosing(spec.gpu_choices[1], capacity="spot", cost_per_hour=0.8)
    assert (l4.gpu_type, l4.gpu, l4.gpu_choices) == ("l4", 2, (GpuChoice("l4", 2),))
    assert l4.env["A"] == "1" and json.loads(l4.env[ENV_RESOURCES]) == {
        "gpu_type": "l4", "gpu": 2, "capacity": "spot", "cost_per_hour": 0.8}
    assert spec.gpu_choices[1] in spec.gpu_choices and ENV_RESOURCES not in spec.env  # the original is kept


def test_a_renamed_job_is_found_by_its_new_id_only() -> None:
    b = LocalBackend()
    try:
        job = b.start_job(JobSpec(command=["sleep", "30"]))
        old = job.id
        b.rename_job(job, "pod-2")
        assert b.job_by_id("pod-2") is job and b.job_by_id(old) is None and job.id == "pod-2"
        assert b.jobs == [job]
        b.stop_job(job, force=True)
        assert b.wait_for_job(job, T) == -9
        assert b.jobs == []
    finally:
        b.cleanup()


def test_capacity_kinds_and_the_order_of_alternatives() -> None:
    assert capacity_kinds(None) == () and capacity_kinds("spot") == ("spot",)
    assert capacity_kinds("spot-then-on-demand") == ("spot", "on-demand")
    with pytest.raises(ConfigError, match="expected one of 'spot', 'on-demand', 'spot-then-on-demand'"):
        capacity_kinds("cheap")
    spec = JobSpec(command=[], gpu_type=["a100", ("l4", 2)], capacity="spot-then-on-demand")  # type: ignore[arg-type]
    assert spec.alternatives == (Alternative(GpuChoice("a100", 1), "spot"), Alternative(GpuChoice("l4", 2), "spot"),
                                 Alternative(GpuChoice("a100", 1), "on-demand"),
                                 Alternative(GpuChoice("l4", 2), "on-demand"))
    assert JobSpec(command=[], capacity="on-demand").alternatives == (Alternative(None, "on-demand"),)
    assert JobSpec(command=[]).alternatives == ()
    cpu_spot = JobSpec(command=[], capacity="spot-then-on-demand").choosing(Alternative(None, "spot"))
    assert cpu_spot.capacity == "spot" and json.loads(cpu_spot.env[ENV_RESOURCES])["capacity"] == "spot"
    with pytest.raises(ConfigError, match="capacity='cheap'"):
        JobSpec(command=[], capacity="cheap")


def test_a_backend_without_capacity_kinds_refuses_a_request_for_one() -> None:
    b = _OneTypeOnly()
    try:
        with pytest.raises(BackendError, match=r"cannot choose spot or on-demand capacity \(w asks for capacity='spot'\)"):
            b.start_job(JobSpec(command=["true"], name="w", capacity="spot"))
    finally:
        b.cleanup()
    with pytest.raises(ConfigError, match="capacity='cheap'"):
        mp.Process(target=print, capacity="cheap")
    with pytest.raises(ConfigError, match="capacity='cheap'"):
        mp.meta(capacity="cheap")


def test_the_price_of_the_place_chosen_reaches_the_jobs_record() -> None:
    spot, on_demand = Alternative(GpuChoice("l4", 2), "spot"), Alternative(GpuChoice("l4", 2), "on-demand")
    spec = JobSpec(command=[], gpu_type="l4:2", capacity="spot-then-on-demand", costs={spot: 1.0, on_demand: 3.0})
    assert json.loads(spec.choosing(on_demand).env[ENV_RESOURCES])["cost_per_hour"] == 3.0
    assert json.loads(spec.choosing(spot, cost_per_hour=0.5).env[ENV_RESOURCES])["cost_per_hour"] == 0.5  # own price wins
    assert json.loads(JobSpec(command=[]).choosing(None).env[ENV_RESOURCES])["cost_per_hour"] is None
