"""The packet delay tool (``fiber_core.testing.netdelay``, ``nfqueue``): its pure parts, then
the tool on a real netfilter queue in a network namespace of the test's own (root only)."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from fiber_core.testing import nfqueue
from fiber_core.testing.netdelay import (
    Counters,
    DelayLine,
    PacketDelay,
    Shape,
    iptables_for,
    queue_rules,
)

FLOW_A = (b"\x0a\x00\x00\x01", b"\x0a\x00\x00\x02", 40000, 7000)
FLOW_B = (b"\x0a\x00\x00\x02", b"\x0a\x00\x00\x01", 7000, 40000)


def released(line: DelayLine, arrivals: list[tuple[int, tuple[bytes, bytes, int, int]]],
             step: float = 0.001) -> list[tuple[float, int]]:
    """Admit packets ``(id, flow)`` one every ``step`` s; every release (time, id) at the
    moment it is due, as a tool serving the queue without lag would give it."""
    out = []
    for i, (packet_id, flow) in enumerate(arrivals):
        now = i * step
        out += [(now, p) for p in line.due(now)]
        line.admit(packet_id, flow, now)
    while (at := line.next_at()) is not None:
        out += [(at, p) for p in line.due(at)]
    return out


def test_a_shape_out_of_range_is_refused_with_what_to_give() -> None:
    with pytest.raises(ValueError, match="0 <= low <= high"):
        Shape(delay=(0.2, 0.05)).check()
    with pytest.raises(ValueError, match="fraction of packets held back"):
        Shape(reorder=1.5).check()


def test_delayed_packets_keep_their_order_and_each_waits_at_least_the_least_delay() -> None:
    line = DelayLine(Shape(delay=(0.05, 0.2)), seed=3)
    arrivals = [(i, FLOW_A if i % 2 else FLOW_B) for i in range(500)]
    out = released(line, arrivals)
    assert sorted(p for _, p in out) == list(range(500))  # each once
    for flow in (FLOW_A, FLOW_B):
        ids = [p for _, p in out if arrivals[p][1] == flow]
        assert ids == sorted(ids)  # no reordering within a connection
    assert all(at - p * 0.001 >= 0.05 - 1e-9 for at, p in out)
    c = line.counters
    assert (c.queued, c.released, c.delayed, c.reordered, c.early) == (500, 500, 500, 0, 0)
    assert 0.05 <= c.delay_mean <= c.delay_max


def test_a_fraction_of_packets_held_back_goes_after_later_ones_and_is_counted() -> None:
    line = DelayLine(Shape(delay=(0.0, 0.002), reorder=0.1, hold=(0.02, 0.06)), seed=5)
    out = released(line, [(i, FLOW_A) for i in range(1000)])
    ids = [p for _, p in out]
    assert sorted(ids) == list(range(1000))
    late = sum(1 for k, p in enumerate(ids) if any(q > p for q in ids[max(0, k - 80):k]))
    assert line.counters.reordered == late > 50  # about a tenth of them


def test_the_same_seed_gives_each_packet_the_same_release() -> None:
    shape = Shape(delay=(0.05, 0.2), reorder=0.2)
    runs = [released(DelayLine(shape, seed), [(i, FLOW_A) for i in range(200)]) for seed in (9, 9, 10)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_drain_releases_every_packet_still_held() -> None:
    line = DelayLine(Shape(delay=(1.0, 2.0)), seed=0)
    for i in range(10):
        line.admit(i, FLOW_A, 0.0)
    assert line.due(0.5) == []
    assert line.drain(0.5) == list(range(10))
    assert line.next_at() is None and line.counters.released == line.counters.early == 10


def test_the_rules_queue_both_directions_of_the_servers_port_only() -> None:
    rules = queue_rules(7000, "10.231.77.1", 7000)
    assert rules == [
        ("OUTPUT", ["-p", "tcp", "-d", "10.231.77.1", "--dport", "7000",
                    "-j", "NFQUEUE", "--queue-num", "7000", "--queue-bypass"]),
        ("INPUT", ["-p", "tcp", "-s", "10.231.77.1", "--sport", "7000",
                   "-j", "NFQUEUE", "--queue-num", "7000", "--queue-bypass"]),
    ]


def test_the_rules_of_an_ipv6_server_are_ip6tables_rules() -> None:
    assert iptables_for("fd00::1") == "ip6tables"
    assert iptables_for("10.231.77.1") == "iptables"


def test_a_verdict_message_carries_the_queue_and_the_packet_id() -> None:
    msg = nfqueue.encode_verdict(7000, 42, nfqueue.ACCEPT)
    length, kind, flags, _, _ = struct.unpack_from("=IHHII", msg)
    assert (length, kind, flags) == (len(msg), nfqueue.MSG_VERDICT, nfqueue.NLM_F_REQUEST)
    assert struct.unpack_from(">H", msg, 18)[0] == 7000  # nfgenmsg's res_id
    attrs = nfqueue.attributes(msg[20:])
    assert struct.unpack(">II", attrs[nfqueue.ATTR_VERDICT_HDR]) == (nfqueue.ACCEPT, 42)


def _packet_message(packet_id: int, payload: bytes) -> bytes:
    attrs = (nfqueue._attr(nfqueue.ATTR_PACKET_HDR, struct.pack(">IHB", packet_id, 0x0800, 1))
             + nfqueue._attr(nfqueue.ATTR_PAYLOAD, payload))
    return nfqueue._message(nfqueue.MSG_PACKET, 0, 0, 7000, attrs)


def test_packets_and_answers_are_read_from_one_buffer() -> None:
    ip = bytes([0x45]) + bytes(8) + bytes([socket.IPPROTO_TCP]) + bytes(2) + FLOW_A[0] + FLOW_A[1]
    tcp = struct.pack(">HH", 40000, 7000) + bytes(16)
    error = struct.pack("=IHHII", 16 + 4, nfqueue.NLMSG_ERROR, 0, 7, 0) + struct.pack("=i", -16)
    items = list(nfqueue.decode(_packet_message(5, ip + tcp) + error + _packet_message(6, ip)))
    assert items[0] == nfqueue.Packet(5, ip + tcp)
    assert items[1] == nfqueue.Answer(7, -16)
    assert items[2].id == 6
    assert nfqueue.flow_of(items[0].payload) == FLOW_A
    assert nfqueue.flow_of(items[2].payload) is None  # copied too short to read the ports


def test_the_flow_of_an_ipv6_packet_and_of_other_protocols() -> None:
    src, dst = bytes(15) + b"\1", bytes(15) + b"\2"
    ip6 = bytes([0x60]) + bytes(5) + bytes([socket.IPPROTO_UDP, 64]) + src + dst
    assert nfqueue.flow_of(ip6 + struct.pack(">HH", 53, 5353)) == (src, dst, 53, 5353)
    icmp = bytes([0x45]) + bytes(8) + bytes([socket.IPPROTO_ICMP]) + bytes(10) + bytes(8)
    assert nfqueue.flow_of(icmp) is None


def test_a_queue_number_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="0 to 65535"):
        nfqueue.QueueSocket(70000)


ECHO = textwrap.dedent("""
    import socket, sys, threading
    n, host, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    srv = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    def echo():
        s, _ = srv.accept()
        while data := s.recv(65536):
            s.sendall(data)
    threading.Thread(target=echo, daemon=True).start()
    c = socket.create_connection((host, port))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sent = b"".join(b"%05d" % i * 20 for i in range(n))
    for i in range(n):
        c.sendall(sent[i * 100:(i + 1) * 100])
    got = b""
    while len(got) < len(sent):
        got += c.recv(65536)
    print("intact" if got == sent else "corrupt", flush=True)
""")


@pytest.fixture
def netns() -> Iterator[str]:
    """A network namespace of this test's own, with only its loopback up."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("iptables"):
        pytest.skip("needs root, ip and iptables (a network namespace and a netfilter queue)")
    name = f"fiber-nd-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, timeout=30)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], timeout=30)


def _echo_through(netns: str, shape: Shape, messages: int, server: str = "127.0.0.1") -> tuple[str, Counters]:
    port = 7000
    with PacketDelay(port, server, netns=netns, shape=shape, seed=11) as delay:
        out = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", ECHO, str(messages),
                              server, str(port)], capture_output=True, text=True, timeout=120)
        live = delay.counters()
    assert out.returncode == 0, out.stderr
    final = delay.final
    assert final is not None and final.released == final.queued >= live.released
    rules = subprocess.run(["ip", "netns", "exec", netns, iptables_for(server), "-S"], capture_output=True,
                           text=True, check=True, timeout=30).stdout
    assert "NFQUEUE" not in rules  # removed on exit
    return out.stdout.strip(), final


@pytest.mark.parametrize("server", ["127.0.0.1", "::1"])
def test_the_tool_delays_every_packet_of_the_port_and_the_stream_arrives_intact(netns: str, server: str) -> None:
    result, c = _echo_through(netns, Shape(delay=(0.05, 0.2)), 30, server)
    assert result == "intact"
    assert c.queued > 0 and c.delayed + c.early >= c.released  # held, but for what the end cut short
    assert c.delay_mean >= 0.05


def test_the_tool_reorders_packets_and_tcp_still_delivers_the_stream_in_order(netns: str) -> None:
    result, c = _echo_through(netns, Shape(delay=(0.0, 0.002), reorder=0.2, hold=(0.02, 0.06)), 300)
    assert result == "intact"
    assert c.reordered > 0, c


def test_a_namespace_that_does_not_exist_is_an_immediate_error_naming_it(netns: str) -> None:
    with pytest.raises(RuntimeError, match=f"{netns}-missing"):
        PacketDelay(7000, "127.0.0.1", netns=f"{netns}-missing").start()
