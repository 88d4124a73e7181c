"""A client of the kernel's netfilter queue (nfnetlink_queue) in pure Python, for network faults.

An ``iptables ... -j NFQUEUE --queue-num N`` rule hands each packet it matches to the process
bound to queue ``N`` in that network namespace, which decides when and whether the packet goes
on (its *verdict*). This module speaks that protocol over a ``NETLINK_NETFILTER`` socket with
the standard library only: the message encoders and the decoder are pure functions (unit
tests build and read messages without a kernel); :class:`QueueSocket` is the I/O edge::

    with QueueSocket(7) as q:             # bind queue 7 (root: CAP_NET_ADMIN in the namespace)
        for packet in q.receive():        # blocks until packets come
            q.verdict(packet.id, ACCEPT)

The protocol is the kernel's ``include/uapi/linux/netfilter/nfnetlink_queue.h``: a netlink
header, a ``nfgenmsg`` whose ``res_id`` is the queue number (big-endian), then attributes.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import Iterator
from typing import NamedTuple

NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_NO_ENOBUFS = 5

NLMSG_ERROR = 2
NLM_F_REQUEST = 1
NLM_F_ACK = 4
NFNL_SUBSYS_QUEUE = 3
MSG_PACKET = NFNL_SUBSYS_QUEUE << 8 | 0
MSG_VERDICT = NFNL_SUBSYS_QUEUE << 8 | 1
MSG_CONFIG = NFNL_SUBSYS_QUEUE << 8 | 2

CFG_CMD, CFG_PARAMS, CFG_QUEUE_MAXLEN, CFG_MASK, CFG_FLAGS = 1, 2, 3, 4, 5
CMD_BIND, CMD_UNBIND = 1, 2
COPY_PACKET = 2
CFG_F_FAIL_OPEN = 1
"""A full queue lets packets through instead of dropping them: a fault tool must not add loss."""

ATTR_PACKET_HDR, ATTR_VERDICT_HDR, ATTR_PAYLOAD = 1, 2, 10
DROP, ACCEPT = 0, 1

_NLMSGHDR = struct.Struct("=IHHII")  # length, type, flags, sequence, port id (host order)
_NFGENMSG = struct.Struct("=BB2s")  # family, version, res_id (big-endian, packed apart)
_NLATTR = struct.Struct("=HH")  # length, type


class QueueError(OSError):
    """The kernel refused a queue request (``errno`` says why)."""


class Packet(NamedTuple):
    """A queued packet: the id its verdict names, and the first bytes of its IP packet."""

    id: int
    payload: bytes


def _attr(kind: int, data: bytes) -> bytes:
    pad = -len(data) % 4
    return _NLATTR.pack(_NLATTR.size + len(data), kind) + data + b"\0" * pad


def _message(kind: int, flags: int, seq: int, queue: int, attrs: bytes) -> bytes:
    body = _NFGENMSG.pack(socket.AF_UNSPEC, 0, struct.pack(">H", queue)) + attrs
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), kind, flags, seq, 0) + body


def encode_bind(queue: int, seq: int, family: int = socket.AF_INET) -> bytes:
    """The request that binds ``queue`` to this socket (acknowledged)."""
    return _message(MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK, seq, queue,
                    _attr(CFG_CMD, struct.pack(">BxH", CMD_BIND, family)))


def encode_params(queue: int, seq: int, copy_range: int, maxlen: int) -> bytes:
    """The request that makes ``queue`` copy each packet's first ``copy_range`` bytes, hold up
    to ``maxlen`` packets and let packets through when full (acknowledged)."""
    attrs = (_attr(CFG_PARAMS, struct.pack(">IB", copy_range, COPY_PACKET))
             + _attr(CFG_QUEUE_MAXLEN, struct.pack(">I", maxlen))
             + _attr(CFG_FLAGS, struct.pack(">I", CFG_F_FAIL_OPEN))
             + _attr(CFG_MASK, struct.pack(">I", CFG_F_FAIL_OPEN)))
    return _message(MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK, seq, queue, attrs)


def encode_verdict(queue: int, packet_id: int, verdict: int) -> bytes:
    """The verdict on one packet of ``queue`` (not acknowledged: the kernel answers errors only)."""
    return _message(MSG_VERDICT, NLM_F_REQUEST, 0, queue,
                    _attr(ATTR_VERDICT_HDR, struct.pack(">II", verdict, packet_id)))


def attributes(data: bytes) -> dict[int, bytes]:
    """The attributes of a message body, by type (the nested and byte-order flags masked off)."""
    found: dict[int, bytes] = {}
    at = 0
    while at + _NLATTR.size <= len(data):
        length, kind = _NLATTR.unpack_from(data, at)
        if length < _NLATTR.size:
            break
        found[kind & 0x3FFF] = data[at + _NLATTR.size:at + length]
        at += length + (-length % 4)
    return found


class Answer(NamedTuple):
    """The kernel's answer to a request: ``error`` 0 is an acknowledgement, else a negative errno."""

    seq: int
    error: int


def decode(buffer: bytes) -> Iterator[Packet | Answer]:
    """The packets and answers in what one ``recv`` returned; other messages are skipped."""
    at = 0
    while at + _NLMSGHDR.size <= len(buffer):
        length, kind, _flags, seq, _port = _NLMSGHDR.unpack_from(buffer, at)
        if length < _NLMSGHDR.size:
            break
        body = buffer[at + _NLMSGHDR.size:at + length]
        at += length + (-length % 4)
        if kind == NLMSG_ERROR:
            yield Answer(seq, struct.unpack_from("=i", body)[0])
        elif kind == MSG_PACKET:
            attrs = attributes(body[_NFGENMSG.size:])
            if ATTR_PACKET_HDR in attrs:
                packet_id = struct.unpack_from(">I", attrs[ATTR_PACKET_HDR])[0]
                yield Packet(packet_id, attrs.get(ATTR_PAYLOAD, b""))


Flow = tuple[bytes, bytes, int, int]
"""A direction of a connection: source and destination address, source and destination port."""


def flow_of(payload: bytes) -> Flow | None:
    """The direction of the TCP or UDP connection an IPv4 or IPv6 packet belongs to; None for
    anything else, or a packet copied too short to tell."""
    if not payload:
        return None
    version = payload[0] >> 4
    if version == 4 and len(payload) >= 20:
        proto, start = payload[9], (payload[0] & 0xF) * 4
        src, dst = payload[12:16], payload[16:20]
    elif version == 6 and len(payload) >= 40:
        proto, start = payload[6], 40  # extension headers are not followed
        src, dst = payload[8:24], payload[24:40]
    else:
        return None
    if proto not in (socket.IPPROTO_TCP, socket.IPPROTO_UDP) or len(payload) < start + 4:
        return None
    sport, dport = struct.unpack_from(">HH", payload, start)
    return src, dst, sport, dport


class QueueSocket:
    """A netlink socket bound to one netfilter queue of this process's network namespace."""

    def __init__(self, queue: int, copy_range: int = 128, maxlen: int = 8192) -> None:
        if not 0 <= queue < 1 << 16:
            raise ValueError(f"queue number {queue} is out of range: use 0 to 65535")
        self.queue = queue
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            self.sock.bind((0, 0))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            self.sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
            self._request(encode_bind(queue, 1), 1, "bind")
            self._request(encode_params(queue, 2, copy_range, maxlen), 2, "configure")
        except BaseException:
            self.sock.close()
            raise

    def _request(self, message: bytes, seq: int, what: str) -> None:
        self.sock.send(message)
        while True:
            for item in decode(self.sock.recv(1 << 16)):
                if isinstance(item, Answer) and item.seq == seq:
                    if item.error:
                        code = -item.error
                        hint = (" (another process holds it: pick another queue number)"
                                if code == errno.EBUSY else "")
                        raise QueueError(code, f"cannot {what} netfilter queue {self.queue}: "
                                               f"{os.strerror(code)}{hint}")
                    return

    def fileno(self) -> int:
        return self.sock.fileno()

    def receive(self) -> list[Packet]:
        """The packets of one read (blocks until there is one); answers to verdicts are dropped."""
        try:
            data = self.sock.recv(1 << 20)
        except OSError as e:
            if e.errno == errno.ENOBUFS:  # the kernel let packets through unqueued (fail-open)
                return []
            raise
        return [item for item in decode(data) if isinstance(item, Packet)]

    def verdict(self, packet_id: int, verdict: int = ACCEPT) -> None:
        self.sock.send(encode_verdict(self.queue, packet_id, verdict))

    def close(self) -> None:
        """Unbind: the kernel drops the packets still held, so give their verdicts first."""
        self.sock.close()

    def __enter__(self) -> QueueSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
