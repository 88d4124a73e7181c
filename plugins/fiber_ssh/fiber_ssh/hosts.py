"""The host list: parsing ``[ssh] hosts`` and choosing a host for each job.

Syntax of one host (hosts are separated by commas or spaces)::

    [user@]host[:port][*slots][[key=value,...]]

    alice@gpu1:2222*8[gpu=2,gpu_type=a10g,cost=1.2]
    gpu2*4
    [fe80::1%eth0]:22          (an IPv6 address goes in brackets)

``slots`` is how many jobs the host runs at once before it counts as full
(default: its CPU count, read when Fiber connects). Keys in brackets: ``gpu``
(number of GPUs), ``gpu_type`` (their model, matched case-insensitively against
``meta(gpu_type=...)``), ``slots``, ``cost`` (what the host costs per hour, which its
jobs see in ``current_process().resources``) and ``capacity`` (``spot`` or ``on-demand``, the
default: the kind of machine it is; a job that asks for a capacity kind goes only to hosts of
that kind, and the loss of a spot host ends its jobs as preempted).

Placement (:func:`place`, and :func:`place_alternative` for GPU alternatives and capacity kinds
in order of preference) is pure bookkeeping, kept apart from SSH so that it can be read and
tested alone.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from fiber_core.contract import Alternative, BackendError, ConfigError, GpuChoice, choice_text

_HOST = re.compile(
    r"""^(?:(?P<user>[^@\s\[\]]+)@)?
        (?P<host>\[[^\]]+\]|[^:*\[\]@\s]+)
        (?::(?P<port>\d+))?
        (?:\*(?P<slots>\d+))?
        (?:\[(?P<opts>[^\]]*)\])?$""",
    re.X,
)
_OPTION_KEYS = ("gpu", "gpu_type", "slots", "cost", "capacity")
CAPACITY_KINDS = ("spot", "on-demand")
"""The kinds a host's ``capacity`` label may name; a host without the label is on-demand."""


@dataclass(frozen=True)
class HostSpec:
    """One entry of the host list, as written (``user``/``port`` ``None`` when not given)."""

    host: str
    user: str | None = None
    port: int | None = None
    slots: int | None = None
    gpu: int = 0
    gpu_type: str | None = None
    text: str = ""
    """The entry as written, for messages."""
    cost: float | None = None
    """What the host costs per hour (the ``cost`` label), if given."""
    capacity: str = "on-demand"
    """The kind of machine (the ``capacity`` label): ``spot`` or ``on-demand``."""


def split_hosts(text: str) -> list[str]:
    """Split a host list at commas and spaces that are not inside brackets."""
    out: list[str] = []
    depth = 0
    current = ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(0, depth - 1)
        if depth == 0 and (ch == "," or ch.isspace()):
            if current:
                out.append(current)
            current = ""
        else:
            current += ch
    if current:
        out.append(current)
    return out


def parse_host(text: str) -> HostSpec:
    """Parse one host entry; raise :class:`ConfigError` that shows the syntax."""
    m = _HOST.match(text.strip())
    if not m:
        raise ConfigError(
            f"bad host {text!r} in [ssh] hosts: expected [user@]host[:port][*slots]"
            "[[gpu=N,gpu_type=T]], e.g. alice@gpu1:22*8[gpu=2,gpu_type=a10g]"
        )
    host = m["host"]
    if host.startswith("["):
        host = host[1:-1]
    labels = _labels(m["opts"] or "", text)
    slots = int(labels["slots"]) if "slots" in labels else int(m["slots"]) if m["slots"] else None
    gpu, gpu_type, cost = int(labels.get("gpu", 0)), labels.get("gpu_type"), labels.get("cost")
    if slots is not None and slots < 1:
        raise ConfigError(f"bad host {text!r} in [ssh] hosts: slots must be at least 1")
    if gpu_type and not gpu:
        raise ConfigError(f"bad host {text!r} in [ssh] hosts: gpu_type needs gpu=N (how many)")
    port = int(m["port"]) if m["port"] else None
    if port is not None and not 0 < port < 65536:
        raise ConfigError(f"bad port in host {text!r} of [ssh] hosts")
    return HostSpec(host=host, user=m["user"], port=port, slots=slots, gpu=gpu,
                    gpu_type=gpu_type, text=text.strip(), cost=float(cost) if cost is not None else None,
                    capacity=labels.get("capacity", "on-demand"))


def _labels(opts: str, text: str) -> dict[str, str]:
    """The ``key=value`` labels in a host's brackets, each checked: counts are whole numbers,
    a cost a non-negative number."""
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in opts.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep or key not in _OPTION_KEYS or not value:
            raise ConfigError(
                f"bad option {item!r} of host {text!r} in [ssh] hosts: expected key=value "
                f"with key one of {', '.join(_OPTION_KEYS)}"
            )
        if key in ("gpu", "slots") and not value.isdigit():
            raise ConfigError(f"bad option {item!r} of host {text!r} in [ssh] hosts: {key} is a count")
        if key == "cost":
            try:
                ok = float(value) >= 0
            except ValueError:
                ok = False
            if not ok:
                raise ConfigError(f"bad option {item!r} of host {text!r} in [ssh] hosts: cost is what the host "
                                  "costs per hour, a number at least 0 (cost=1.2)")
        if key == "capacity" and value.lower() not in CAPACITY_KINDS:
            raise ConfigError(f"bad option {item!r} of host {text!r} in [ssh] hosts: capacity is the kind of "
                              f"machine, {' or '.join(CAPACITY_KINDS)} (capacity=spot)")
        out[key] = value.lower() if key == "capacity" else value
    return out


def parse_hosts(text: str | None) -> list[HostSpec]:
    """Parse the whole ``[ssh] hosts`` setting; an empty one is an error that says what to set."""
    entries = split_hosts(text or "")
    if not entries:
        raise ConfigError(
            "no SSH hosts configured: set [ssh] hosts in .fiberconfig, FIBER_SSH_HOSTS or "
            "fiber_core.init(ssh_hosts=...), e.g. 'alice@gpu1*8, gpu2*4'"
        )
    specs = [parse_host(e) for e in entries]
    seen: set[tuple[str, int | None, str | None]] = set()
    for s in specs:
        key = (s.host, s.port, s.user)
        if key in seen:
            raise ConfigError(f"host {s.text!r} is listed twice in [ssh] hosts: give it more slots instead")
        seen.add(key)
    return specs


@dataclass
class Slots:
    """What one host has and what the jobs placed on it use. Guarded by the backend's lock."""

    name: str
    slots: int
    gpus: int = 0
    gpu_type: str | None = None
    used: int = 0
    cost: float | None = None
    """What the host costs per hour, if its labels say."""
    capacity: str = "on-demand"
    """The kind of machine, by its labels: ``spot`` or ``on-demand``."""
    gpu_used: list[int] = field(default_factory=list)
    """Jobs using each GPU, by index."""
    alive: bool = True

    def __post_init__(self) -> None:
        if len(self.gpu_used) != self.gpus:
            self.gpu_used = [0] * self.gpus

    @property
    def free(self) -> int:
        return self.slots - self.used

    @property
    def free_gpus(self) -> int:
        return sum(1 for n in self.gpu_used if n == 0)


@dataclass(frozen=True)
class Placement:
    """Where a job goes: the host's index, the slots it takes, the GPU indices it gets."""

    index: int
    slots: int
    gpus: tuple[int, ...] = ()


def job_slots(cpu: float | None) -> int:
    """Slots a job takes: its CPU request rounded up, at least one."""
    return max(1, math.ceil(cpu)) if cpu else 1


def place(hosts: Sequence[Slots], cpu: float | None = None, gpu: int | None = None,
          gpu_type: str | None = None, capacity: str | None = None) -> Placement:
    """Choose a live host for a job and reserve what it takes there.

    CPU jobs go to the live host with the most free slots (the first listed on a tie),
    over its limit when every host is full. A GPU job (``gpu`` > 0, or ``-1`` for every
    GPU of the host) goes only to hosts that declare enough GPUs of ``gpu_type``: the
    one with the most free GPUs, then the most free slots; it gets the least used GPUs.
    A job that names a ``capacity`` kind goes only to hosts of that kind.
    Raise :class:`BackendError` when no host can ever take the job, or none is alive.
    """
    need = job_slots(cpu)
    candidates: Iterable[int] = range(len(hosts))
    if capacity is not None:
        candidates = [i for i, h in enumerate(hosts) if h.capacity == capacity]
        if not candidates:
            kinds = ", ".join(f"{h.name} ({h.capacity})" for h in hosts)
            raise BackendError(f"no SSH host is labelled capacity={capacity} (hosts: {kinds}); label the "
                               f"{capacity} hosts in [ssh] hosts, e.g. 'spot1*8[capacity=spot]'")
    if gpu:
        fits = [i for i in candidates if _gpu_fits(hosts[i], gpu, gpu_type)]
        if not fits:
            declared = ", ".join(
                f"{h.name} ({h.gpus}x {h.gpu_type or 'any type'})" for h in hosts if h.gpus
            ) or "none"
            want = "every GPU of a host" if gpu < 0 else f"{gpu} GPU(s)"
            raise BackendError(
                f"no SSH host can run a job that asks for {want}"
                + (f" of type {gpu_type!r}" if gpu_type else "")
                + f"; hosts that declare GPUs: {declared}. Declare them in [ssh] hosts, "
                "e.g. 'gpu1*8[gpu=2,gpu_type=a10g]'"
            )
        candidates = fits
    alive = [i for i in candidates if hosts[i].alive]
    if not alive:
        names = ", ".join(hosts[i].name for i in candidates)
        raise BackendError(f"no SSH host is reachable to run the job (lost: {names})")
    return _reserve(hosts, alive, need, gpu or 0)


def _reserve(hosts: Sequence[Slots], candidates: Sequence[int], need: int, gpu: int) -> Placement:
    """Take ``need`` slots and ``gpu`` GPUs on the best of ``candidates``: for a GPU job the host
    with the most free GPUs, then the most free slots; else the most free slots (the first
    listed on a tie). The job gets the least used GPUs."""
    if gpu:
        best = max(candidates, key=lambda i: (hosts[i].free_gpus, hosts[i].free, -i))
    else:
        best = max(candidates, key=lambda i: (hosts[i].free, -i))
    h = hosts[best]
    gpus: tuple[int, ...] = ()
    if gpu:
        count = h.gpus if gpu < 0 else gpu
        order = sorted(range(h.gpus), key=lambda g: (h.gpu_used[g], g))
        gpus = tuple(sorted(order[:count]))
        for g in gpus:
            h.gpu_used[g] += 1
    h.used += need
    return Placement(best, need, gpus)


def place_alternative(hosts: Sequence[Slots], cpu: float | None, places: Sequence[Alternative],
                      gpu: int = 0) -> tuple[Placement, Alternative]:
    """Place a job that names alternatives in order of preference (GPU types, capacity kinds:
    ``JobSpec.alternatives``; ``gpu`` GPUs of no named type where one names none): on the first
    that a live host of its kind has free room for (free GPUs of its type and free slots); when
    none has, as :func:`place` places the first that any host can take (sharing GPUs, over
    the slots). Raise :class:`BackendError` when no host can ever take any of them."""
    need = job_slots(cpu)
    asks = [(alt.gpu.count, alt.gpu.type) if alt.gpu is not None else (gpu, None) for alt in places]
    for alt, (count, gpu_type) in zip(places, asks):
        free = [i for i, h in enumerate(hosts)
                if h.alive and h.free >= need and (alt.capacity is None or h.capacity == alt.capacity)
                and (not count or (_gpu_fits(h, count, gpu_type) and h.free_gpus >= (h.gpus if count < 0 else count)))]
        if free:
            return _reserve(hosts, free, need, count), alt
    errors: list[str] = []
    for alt, (count, gpu_type) in zip(places, asks):
        try:
            return place(hosts, cpu, count, gpu_type, alt.capacity), alt
        except BackendError as e:
            errors.append(str(e))
    if len(places) == 1:
        raise BackendError(errors[0])
    what = "GPU alternatives" if all(alt.capacity is None for alt in places) else "alternatives"
    raise BackendError(f"no SSH host can run any of the {what} {choice_text(places)}: {errors[0]}")


def place_choice(hosts: Sequence[Slots], cpu: float | None, choices: Sequence[GpuChoice]) -> tuple[Placement, GpuChoice]:
    """:func:`place_alternative` for GPU alternatives alone (on any capacity kind)."""
    placement, alt = place_alternative(hosts, cpu, [Alternative(c) for c in choices])
    assert alt.gpu is not None
    return placement, alt.gpu


def release(hosts: Sequence[Slots], placement: Placement) -> None:
    """Give back what :func:`place` reserved."""
    h = hosts[placement.index]
    h.used -= placement.slots
    for g in placement.gpus:
        h.gpu_used[g] -= 1


def crowding(hosts: Sequence[Slots], placed: Sequence[Placement]) -> list[int]:
    """Which of the jobs ``placed`` (in the order they started) should move: those a host runs
    over its slots while another live host has free ones.

    Returns their indices in ``placed``, the newest of each crowded host first, at most as
    many as that host is over and, in all, as the other live hosts have free slots. Only CPU
    jobs move (a GPU job's place depends on its GPUs). Placement puts their replacements on
    the hosts with room (:func:`place`).
    """
    room = sum(h.free for h in hosts if h.alive and h.free > 0)
    over = {i: -h.free for i, h in enumerate(hosts) if h.free < 0}
    out: list[int] = []
    for n in range(len(placed) - 1, -1, -1):
        p = placed[n]
        if room <= 0:
            break
        if p.gpus or over.get(p.index, 0) <= 0:
            continue
        out.append(n)
        over[p.index] -= p.slots
        room -= p.slots
    return out


def _gpu_fits(h: Slots, gpu: int, gpu_type: str | None) -> bool:
    if not h.gpus or (gpu > 0 and h.gpus < gpu):
        return False
    return not gpu_type or (h.gpu_type or "").lower() == gpu_type.lower()
