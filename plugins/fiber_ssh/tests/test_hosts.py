"""The host list syntax and placement: pure functions, no SSH needed."""

from __future__ import annotations

import pytest
from fiber_core.base.errors import BackendError, ConfigError
from fiber_core.contract import GpuChoice

from fiber_ssh.hosts import (
    HostSpec,
    Slots,
    parse_host,
    parse_hosts,
    place,
    place_choice,
    release,
    split_hosts,
)


def test_split_keeps_brackets_whole() -> None:
    assert split_hosts("a*2, b[gpu=2,gpu_type=a10g]  c\nd") == ["a*2", "b[gpu=2,gpu_type=a10g]", "c", "d"]


@pytest.mark.parametrize("text, expected", [
    ("gpu1", HostSpec("gpu1", text="gpu1")),
    ("alice@gpu1:2222*8", HostSpec("gpu1", "alice", 2222, 8, text="alice@gpu1:2222*8")),
    ("gpu2*4[gpu=2,gpu_type=a10g]", HostSpec("gpu2", None, None, 4, 2, "a10g", "gpu2*4[gpu=2,gpu_type=a10g]")),
    ("bob@[fe80::1]:22[slots=3]", HostSpec("fe80::1", "bob", 22, 3, text="bob@[fe80::1]:22[slots=3]")),
    ("10.0.0.7[gpu=1]", HostSpec("10.0.0.7", gpu=1, text="10.0.0.7[gpu=1]")),
    ("g[gpu=4,gpu_type=l4,cost=2.5]", HostSpec("g", gpu=4, gpu_type="l4", text="g[gpu=4,gpu_type=l4,cost=2.5]",
                                               cost=2.5)),
])
def test_parse_host(text: str, expected: HostSpec) -> None:
    assert parse_host(text) == expected


@pytest.mark.parametrize("text, words", [
    ("gpu1:port", r"expected \[user@\]host"),
    ("gpu1*0", "slots must be at least 1"),
    ("gpu1[gpus=2]", "key one of gpu, gpu_type, slots, cost"),
    ("gpu1[cost=cheap]", "cost is what the host costs per hour"),
    ("gpu1[cost=-1]", "a number at least 0"),
    ("gpu1[gpu=two]", "gpu is a count"),
    ("gpu1[gpu_type=a10g]", "gpu_type needs gpu=N"),
    ("gpu1:70000", "bad port"),
])
def test_bad_host_says_what_is_wrong(text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        parse_host(text)


def test_empty_or_repeated_host_list() -> None:
    with pytest.raises(ConfigError, match="no SSH hosts configured.*FIBER_SSH_HOSTS"):
        parse_hosts("  ")
    with pytest.raises(ConfigError, match="listed twice"):
        parse_hosts("a, b, a")


def test_most_free_slots_first_then_over_the_limit() -> None:
    hosts = [Slots("a", 2), Slots("b", 4), Slots("c", 1)]
    chosen = [place(hosts).index for _ in range(7)]
    assert chosen == [1, 1, 0, 1, 0, 1, 2]
    assert [h.free for h in hosts] == [0, 0, 0]
    assert place(hosts).index == 0  # all full: over the limit, first listed on a tie
    assert hosts[0].free == -1


def test_cpu_takes_slots_and_release_gives_them_back() -> None:
    hosts = [Slots("a", 4), Slots("b", 2)]
    p = place(hosts, cpu=2.5)
    assert (p.index, p.slots) == (0, 3)
    assert place(hosts).index == 1
    release(hosts, p)
    assert hosts[0].free == 4


def test_dead_hosts_are_skipped() -> None:
    hosts = [Slots("a", 8, alive=False), Slots("b", 1)]
    assert place(hosts).index == 1
    hosts[1].alive = False
    with pytest.raises(BackendError, match="no SSH host is reachable"):
        place(hosts)


def test_gpu_jobs_go_to_hosts_that_declare_gpus() -> None:
    hosts = [Slots("cpu", 64), Slots("g1", 8, 2, "a10g"), Slots("g2", 8, 1, "v100")]
    a = place(hosts, gpu=1, gpu_type="A10G")
    b = place(hosts, gpu=1, gpu_type="a10g")
    assert (a.index, a.gpus, b.index, b.gpus) == (1, (0,), 1, (1,))
    c = place(hosts, gpu=1)
    assert (c.index, c.gpus) == (2, (0,))  # the host with a free GPU
    everything = place(hosts, gpu=-1, gpu_type="a10g")
    assert everything.gpus == (0, 1)
    release(hosts, a)
    assert place(hosts, gpu=1, gpu_type="a10g").gpus == (0,)


def test_gpu_job_no_host_can_run_is_a_clear_error() -> None:
    hosts = [Slots("cpu", 64), Slots("g1", 8, 2, "a10g")]
    with pytest.raises(BackendError, match=r"2 GPU\(s\) of type 'v100'.*g1 \(2x a10g\)"):
        place(hosts, gpu=2, gpu_type="v100")
    with pytest.raises(BackendError, match=r"4 GPU\(s\)"):
        place(hosts, gpu=4)
    with pytest.raises(BackendError, match="hosts that declare GPUs: none"):
        place([Slots("cpu", 4)], gpu=1)


def test_gpu_alternatives_go_to_the_first_with_free_room() -> None:
    hosts = [Slots("cpu", 64), Slots("a100", 8, 1, "a100", cost=4.0), Slots("l4", 8, 4, "l4", cost=1.0)]
    choices = (GpuChoice("a100", 1), GpuChoice("l4", 2))
    first, got = place_choice(hosts, None, choices)
    assert (first.index, got) == (1, GpuChoice("a100", 1))
    second, got = place_choice(hosts, None, choices)  # the A100 is taken: two L4s
    assert (second.index, second.gpus, got) == (2, (0, 1), GpuChoice("l4", 2))
    third, _ = place_choice(hosts, None, choices)
    assert (third.index, third.gpus) == (2, (2, 3))
    shared, got = place_choice(hosts, None, choices)  # none free: the first, sharing its GPU
    assert (shared.index, got) == (1, GpuChoice("a100", 1))
    release(hosts, first)
    release(hosts, shared)
    assert place_choice(hosts, None, choices)[1] == GpuChoice("a100", 1)


def test_a_host_without_free_slots_is_not_free_room() -> None:
    hosts = [Slots("a100", 1, 1, "a100"), Slots("l4", 4, 1, "l4")]
    hosts[0].used = 1  # its one slot is taken by a CPU job
    assert place_choice(hosts, None, (GpuChoice("a100", 1), GpuChoice("l4", 1)))[1] == GpuChoice("l4", 1)


def test_alternatives_no_host_declares_fail_naming_them() -> None:
    with pytest.raises(BackendError, match=r"any of the GPU alternatives h100:1, v100:2.*'h100'"):
        place_choice([Slots("g", 8, 2, "a10g")], None, (GpuChoice("h100", 1), GpuChoice("v100", 2)))
