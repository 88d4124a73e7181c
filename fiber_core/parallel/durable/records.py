"""The journal's record format: length-prefixed, checksummed records, pure (no I/O).

A journal file is :data:`MAGIC` (which ends with the format's version) and then
records. Each record is ``length:I crc:I kind:c payload`` in network byte order,
``length`` counting the kind and the payload, ``crc`` the CRC-32 of both. The first
record is the header (:data:`HEADER`, JSON: the program, the run seed); then, in the
order they happened:

* :data:`CALL`: a journalled call began (its :class:`CallIdentity`);
* :data:`UNITS`: units of a call finished (their indices, each one's argument digest where
  the call's identity does not cover its arguments (``imap``),
  and their values): one record per batch of results, never one per item;
* :data:`TRUNCATE`: what was recorded for this call and those after it no longer holds
  (the program went another way from there).

:func:`scan` reads a file's bytes back: it stops at the first record that is torn (the
process died while writing it) or damaged (a flipped bit), and says where and why, so
that the writer can cut the file there and go on after the last good record.
"""

from __future__ import annotations

import json
import pickle
import struct
import zlib
from typing import Any, NamedTuple

from fiber_core.base.blake2 import blake2b

VERSION = 1
"""The format's version: a journal of another version is set aside, not read."""

MAGIC = b"FIBERJNL" + bytes([VERSION])
"""The first bytes of every journal file."""

HEADER, CALL, UNITS, TRUNCATE = b"H", b"C", b"U", b"T"

_PREFIX = struct.Struct("!II")

MAX_RECORD = 1 << 31
"""A length above this is a damaged length field, not a record."""


class CallIdentity(NamedTuple):
    """What makes a recorded call the same call in a later run of the program.

    ``ordinal``: its place in the program's sequence of journalled calls; ``name``: how
    errors name it (``map(evaluate)``); ``func``: a digest of the function; ``args``: a
    digest of all its arguments, or ``b""`` where they are not known up front (``imap``:
    each unit's digest is checked as it comes).
    """

    ordinal: int
    name: str
    func: bytes
    args: bytes


def digest(data: bytes | bytearray | memoryview) -> bytes:
    """The digest of pickled arguments or code: 16 bytes of BLAKE2b."""
    return blake2b(data, digest_size=16).digest()


def encode(kind: bytes, payload: bytes) -> bytes:
    """One record: its length and checksum, its kind, its payload."""
    body = kind + payload
    return _PREFIX.pack(len(body), zlib.crc32(body)) + body


def header(program: str, seed: int) -> bytes:
    """The header record: which program the journal belongs to, and the run's seed."""
    return encode(HEADER, json.dumps({"program": program, "seed": seed}).encode())


def call(identity: CallIdentity) -> bytes:
    return encode(CALL, pickle.dumps(tuple(identity), pickle.HIGHEST_PROTOCOL))


def units(ordinal: int, digests: list[tuple[int, bytes]], values: list[Any]) -> bytes:
    """Units of call ``ordinal`` that finished: ``(index, argument digest)`` and values, in
    the same order. Raises what pickling a value raises."""
    return encode(UNITS, pickle.dumps((ordinal, digests, values), pickle.HIGHEST_PROTOCOL))


def truncate(ordinal: int) -> bytes:
    return encode(TRUNCATE, b"%d" % ordinal)


class Scan(NamedTuple):
    """What :func:`scan` found: the good records, the length of the good prefix, and why
    it stops before the end (None: the file is whole)."""

    records: list[tuple[bytes, bytes]]
    good: int
    problem: str | None


def scan(data: bytes) -> Scan:
    """The records of a journal file's bytes, up to the first torn or damaged one."""
    if not data.startswith(MAGIC[:-1]):
        return Scan([], 0, "it is not a Fiber journal (its first bytes differ)")
    if data[:len(MAGIC)] != MAGIC:
        found = data[len(MAGIC) - 1] if len(data) >= len(MAGIC) else None
        return Scan([], 0, f"it is of format version {found}, this Fiber writes {VERSION}")
    at = len(MAGIC)
    records: list[tuple[bytes, bytes]] = []
    view = memoryview(data)
    while at < len(data):
        n = len(records) + 1
        if len(data) - at < _PREFIX.size:
            return Scan(records, at, f"record {n} at byte {at} is torn (the file ends inside it)")
        length, crc = _PREFIX.unpack_from(data, at)
        end = at + _PREFIX.size + length
        if length < 1 or length > MAX_RECORD:
            return Scan(records, at, f"record {n} at byte {at} is damaged (a length of {length})")
        if end > len(data):
            return Scan(records, at, f"record {n} at byte {at} is torn (the file ends inside it)")
        body = view[at + _PREFIX.size:end]
        if zlib.crc32(body) != crc:
            return Scan(records, at, f"record {n} at byte {at} is damaged (its checksum differs)")
        records.append((bytes(body[:1]), bytes(body[1:])))
        at = end
    return Scan(records, at, None)


def read_header(payload: bytes) -> dict[str, Any]:
    """The header's fields (``program``, ``seed``); ValueError if it is not one."""
    fields = json.loads(payload)
    if not isinstance(fields, dict) or not isinstance(fields.get("program"), str) \
            or not isinstance(fields.get("seed"), int):
        raise ValueError(f"not a journal header: {payload[:80]!r}")
    return fields


def read_call(payload: bytes) -> CallIdentity:
    return CallIdentity(*pickle.loads(payload))


def read_units(payload: bytes) -> tuple[int, list[tuple[int, bytes]], list[Any]]:
    ordinal, digests, values = pickle.loads(payload)
    return ordinal, digests, values


def read_truncate(payload: bytes) -> int:
    return int(payload)


def foreign(scan: Scan, program: str, seed: int | None) -> str | None:
    """Why a journal read back is not this run's (None: it is): not readable, no header,
    another program's, or recorded with another ``seed`` setting."""
    if not scan.records:
        return f"cannot be read: {scan.problem}" if scan.problem else "is empty"
    kind, payload = scan.records[0]
    try:
        fields = read_header(payload) if kind == HEADER else None
    except ValueError:
        fields = None
    if fields is None:
        return "has no header"
    if fields["program"] != program:
        return f"belongs to another program, {fields['program']}, not {program}"
    if seed is not None and fields["seed"] != seed:
        return f"was recorded with seed {fields['seed']}, this run's seed is {seed}"
    return None
