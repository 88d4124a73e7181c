"""Delayed and reordered packets for chaos tests, where the kernel has no ``tc netem``.

An ``iptables`` rule sends the TCP packets of one server port to a netfilter queue
(``NFQUEUE``); a small program bound to that queue holds each packet for a delay drawn from a
seeded distribution, lets a drawn fraction of them go after later ones (reordering), then
accepts them all. ``netem`` would do the same in the kernel, but it is an optional module
(``CONFIG_NET_SCH_NETEM``) that many kernels, the test machines' among them, lack; the
netfilter queue is built into most. Usage, from a test that is root::

    shape = Shape(delay=(0.05, 0.2))                      # or Shape(delay=(0, 0.005), reorder=0.1)
    with PacketDelay(port, server="10.231.77.1", netns="fiber-h1", shape=shape, seed=seed) as d:
        ...                                               # the run
        assert d.counters().delayed                       # live counters
    d.final                                               # the counters when it stopped

The rules match only the given server's address and port (a run's hub), in the given network
namespace, and carry ``--queue-bypass``: should the program die, packets pass undelayed rather
than being dropped. :class:`DelayLine` (what to release when) and :func:`queue_rules` are pure;
the program is ``python -m fiber_core.testing.netdelay`` (it prints ``ready``, answers a
``counters`` line on its stdin with a JSON line, and releases every packet and stops at EOF).
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import os
import random
import select
import subprocess
import sys
import time
from typing import IO, NamedTuple

from fiber_core.testing.nfqueue import Flow, QueueSocket, flow_of

__all__ = ["Counters", "DelayLine", "PacketDelay", "Shape", "iptables_for", "queue_rules"]


class Shape(NamedTuple):
    """What happens to each packet: a delay drawn uniformly from ``delay`` (seconds); with
    probability ``reorder``, ``hold`` more and free to pass later packets of its connection.
    Other packets keep their order: each waits for the one before it."""

    delay: tuple[float, float] = (0.05, 0.2)
    reorder: float = 0.0
    hold: tuple[float, float] = (0.02, 0.06)

    def check(self) -> Shape:
        """This shape, or a ValueError that says which value is wrong."""
        for name, (lo, hi) in (("delay", self.delay), ("hold", self.hold)):
            if not 0 <= lo <= hi:
                raise ValueError(f"{name}={lo, hi}: give (low, high) seconds with 0 <= low <= high")
        if not 0 <= self.reorder <= 1:
            raise ValueError(f"reorder={self.reorder}: give the fraction of packets held back, 0 to 1")
        return self


class Counters(NamedTuple):
    """What the tool did: packets queued and released, released with a delay (over 1 ms),
    released after a later packet of their connection, released before their time because
    the tool stopped, and the delays they got (seconds)."""

    queued: int = 0
    released: int = 0
    delayed: int = 0
    reordered: int = 0
    early: int = 0
    delay_total: float = 0.0
    delay_max: float = 0.0

    @property
    def delay_mean(self) -> float:
        return self.delay_total / self.released if self.released else 0.0


DEFAULT_SHAPE = Shape()
"""50-200 ms on every packet, in order."""

DELAYED = 0.001
"""A packet held longer than this (seconds) counts as delayed."""


class DelayLine:
    """Decides when each queued packet goes on. Pure: the clock is the caller's, and the
    ``n``-th packet gets the same draws under the same seed."""

    def __init__(self, shape: Shape, seed: int) -> None:
        self.shape = shape.check()
        self.rng = random.Random(seed)
        self._heap: list[tuple[float, int, int, Flow | None, int, float]] = []
        self._order = 0  # arrival order: ties release in it
        self._last: dict[Flow | None, float] = {}  # release time of a connection's last in-order packet
        self._arrived: dict[Flow | None, int] = {}
        self._highest: dict[Flow | None, int] = {}  # highest arrival number released, per connection
        self.counters = Counters()

    def admit(self, packet_id: int, flow: Flow | None, now: float) -> float:
        """Take a packet that arrived at ``now``; the time it is to go on."""
        shape = self.shape
        delay, extra = self.rng.uniform(*shape.delay), self.rng.uniform(*shape.hold)
        held_back = self.rng.random() < shape.reorder  # always three draws: replays stay aligned
        at = now + delay
        if held_back:
            at += extra
        else:
            at = max(at, self._last.get(flow, at))
            self._last[flow] = at
        number = self._arrived.get(flow, 0)
        self._arrived[flow] = number + 1
        self._order += 1
        heapq.heappush(self._heap, (at, self._order, packet_id, flow, number, now))
        self.counters = self.counters._replace(queued=self.counters.queued + 1)
        return at

    def next_at(self) -> float | None:
        """When the next packet is due; None while none is held."""
        return self._heap[0][0] if self._heap else None

    def due(self, now: float) -> list[int]:
        """The ids of the packets due by ``now``, in the order they are to go on."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            out.append(self._release(now))
        return out

    def drain(self, now: float) -> list[int]:
        """Every packet still held, in the order they were due (those not due yet count as early)."""
        out = []
        while self._heap:
            out.append(self._release(now))
        return out

    def _release(self, now: float) -> int:
        at, _, packet_id, flow, number, arrived = heapq.heappop(self._heap)
        c = self.counters
        held = now - arrived
        reordered = number < self._highest.get(flow, -1)
        if not reordered:
            self._highest[flow] = number
        self.counters = c._replace(released=c.released + 1, delayed=c.delayed + (held > DELAYED),
                                   reordered=c.reordered + reordered, early=c.early + (at > now),
                                   delay_total=c.delay_total + held,
                                   delay_max=max(c.delay_max, held))
        return packet_id


def iptables_for(server: str) -> str:
    """The command that holds the rules of ``server``'s address family."""
    return "ip6tables" if ":" in server else "iptables"


def queue_rules(port: int, server: str, queue: int) -> list[tuple[str, list[str]]]:
    """The ``iptables`` rules (chain, rule) that queue a client's packets to and from ``server``'s
    TCP ``port``: both directions of every connection to it, nothing else."""
    target = ["-j", "NFQUEUE", "--queue-num", str(queue), "--queue-bypass"]
    return [("OUTPUT", ["-p", "tcp", "-d", server, "--dport", str(port), *target]),
            ("INPUT", ["-p", "tcp", "-s", server, "--sport", str(port), *target])]


def serve(queue: QueueSocket, line: DelayLine, control: int, out: IO[str]) -> Counters:
    """Hold and release ``queue``'s packets until ``control`` reaches EOF, answering each
    ``counters`` line on it with the counters as a JSON line on ``out``; then release the rest."""
    pending = b""
    while True:
        due = line.next_at()
        wait = None if due is None else max(0.0, due - time.monotonic())
        ready, _, _ = select.select([queue.fileno(), control], [], [], wait)
        if queue.fileno() in ready:
            for packet in queue.receive():
                line.admit(packet.id, flow_of(packet.payload), time.monotonic())
        if control in ready:
            data = os.read(control, 4096)
            if not data:
                break
            pending += data
            while b"\n" in pending:
                _, pending = pending.split(b"\n", 1)
                print(json.dumps(line.counters._asdict()), file=out, flush=True)
        for packet_id in line.due(time.monotonic()):
            queue.verdict(packet_id)
    for packet_id in line.drain(time.monotonic()):
        queue.verdict(packet_id)
    return line.counters


class PacketDelay:
    """The delaying program on one queue of one network namespace, with its rules: started on
    entry, rules removed and every held packet released on exit, whatever happened."""

    def __init__(self, port: int, server: str, *, netns: str | None = None, shape: Shape = DEFAULT_SHAPE,
                 seed: int = 0, queue: int | None = None, timeout: float = 30.0) -> None:
        self.port, self.server, self.netns = port, server, netns
        self.shape, self.seed = shape.check(), seed
        self.queue = port if queue is None else queue  # a run's port is its own: so is the queue
        self.timeout = timeout
        self.final: Counters | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._added: list[list[str]] = []
        self._buffer = b""

    def _in_netns(self, *cmd: str) -> list[str]:
        return (["ip", "netns", "exec", self.netns] if self.netns else []) + list(cmd)

    def start(self) -> PacketDelay:
        s = self.shape
        cmd = self._in_netns(sys.executable, "-m", "fiber_core.testing.netdelay", "--queue", str(self.queue),
                             "--seed", str(self.seed), "--delay", *map(str, s.delay),
                             "--reorder", str(s.reorder), "--hold", *map(str, s.hold))
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE)
        try:
            if self._line() != "ready":
                raise RuntimeError("the packet delay program did not start")
            for chain, rule in queue_rules(self.port, self.server, self.queue):
                command = self._in_netns(iptables_for(self.server))
                subprocess.run([*command, "-I", chain, *rule], check=True, capture_output=True,
                               timeout=self.timeout)
                self._added.append([*command, "-D", chain, *rule])
        except BaseException:
            with contextlib.suppress(Exception):  # the error that stopped the start is the one to see
                self.stop()
            raise
        return self

    def _line(self) -> str:
        """The program's next line of output; an error with its stderr if it ended or is silent."""
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        deadline = time.monotonic() + self.timeout
        fd = proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(0.0, left))
            data = os.read(fd, 4096) if ready else b""
            if not data:
                if ready:
                    proc.wait(self.timeout)
                err = proc.stderr.read().decode(errors="replace") if proc.stderr and ready else ""
                raise RuntimeError(f"the packet delay program on queue {self.queue} "
                                   f"{'ended' if ready else 'did not answer'}: {err.strip()[-2000:]} "
                                   f"(it needs root, a network namespace that exists and a "
                                   f"kernel with netfilter queues, CONFIG_NETFILTER_NETLINK_QUEUE)")
            self._buffer += data
        text, self._buffer = self._buffer.split(b"\n", 1)
        return text.decode()

    def counters(self) -> Counters:
        """The counters now (the final ones once stopped)."""
        if self.final is not None:
            return self.final
        proc = self._proc
        assert proc is not None and proc.stdin is not None, "start() first"
        proc.stdin.write(b"counters\n")
        proc.stdin.flush()
        return Counters(**json.loads(self._line()))

    def stop(self) -> Counters:
        """Remove the rules, release every packet held, end the program; the final counters."""
        while self._added:
            subprocess.run(self._added.pop(), capture_output=True, timeout=self.timeout)
        proc, self._proc = self._proc, None
        if proc is None:
            return self.final or Counters()
        try:
            assert proc.stdin is not None
            proc.stdin.close()
            self._proc = proc
            self.final = Counters(**json.loads(self._line()))
            proc.wait(self.timeout)
        finally:
            self._proc = None
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for stream in (proc.stdout, proc.stderr):
                if stream:
                    stream.close()
        return self.final

    def __enter__(self) -> PacketDelay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fiber_core.testing.netdelay",
                                     description="Delay and reorder the packets of a netfilter queue.")
    parser.add_argument("--queue", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--delay", type=float, nargs=2, default=Shape().delay, metavar=("LOW", "HIGH"))
    parser.add_argument("--reorder", type=float, default=0.0)
    parser.add_argument("--hold", type=float, nargs=2, default=Shape().hold, metavar=("LOW", "HIGH"))
    args = parser.parse_args(argv)
    line = DelayLine(Shape(tuple(args.delay), args.reorder, tuple(args.hold)), args.seed)
    with QueueSocket(args.queue) as queue:
        print("ready", flush=True)
        counters = serve(queue, line, sys.stdin.fileno(), sys.stdout)
    print(json.dumps(counters._asdict()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

