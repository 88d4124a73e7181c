"""Taking variables out of this process's environment for good, so that nothing it starts inherits them.

``os.environ.pop`` unsets a variable for the processes started afterwards, but the
environment the process was started with stays in its memory, as it is, and
``/proc/<pid>/environ`` shows that block to every process of the same user (a program
that a task starts, for one). :func:`forget` does both: it unsets the variables and
overwrites their entries in that block with zero bytes. No pointer of the C library's
``environ`` refers to an entry once it is unset, so nothing reads what was there.
"""

from __future__ import annotations

import os
from collections.abc import Iterable


def entry_spans(block: bytes, names: Iterable[str]) -> list[tuple[int, int]]:
    """(offset, length) of each ``NAME=value`` entry of ``names`` in an environment block
    (entries separated by NUL bytes, as ``/proc/<pid>/environ`` has them)."""
    prefixes = tuple(f"{name}=".encode() for name in names)
    spans = []
    start = 0
    while start < len(block):
        end = block.find(b"\0", start)
        if end < 0:
            end = len(block)
        if block.startswith(prefixes, start):
            spans.append((start, end - start))
        start = end + 1
    return spans


def block_bounds(stat_line: str) -> tuple[int, int]:
    """Where the environment a process started with lies in its memory: (start, end), from
    its ``/proc/<pid>/stat`` line (fields 50 and 51; the command name may hold spaces)."""
    fields = stat_line.rsplit(")", 1)[1].split()  # fields from the third on
    return int(fields[47]), int(fields[48])


def forget(names: Iterable[str]) -> None:
    """Unset ``names`` and wipe them from the environment this process started with.

    Best effort for the second part: where ``/proc`` is missing or cannot be written (not
    Linux, an unusual sandbox), only the variables are unset.
    """
    names = [name for name in names if name in os.environ]
    for name in names:
        del os.environ[name]
    if not names:
        return
    try:
        fd = os.open("/proc/self/stat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            start, end = block_bounds(os.read(fd, 4096).decode("ascii", "replace"))
        finally:
            os.close(fd)
        fd = os.open("/proc/self/mem", os.O_RDWR | os.O_CLOEXEC)
        try:
            for offset, length in entry_spans(os.pread(fd, end - start, start), names):
                os.pwrite(fd, bytes(length), start + offset)
        finally:
            os.close(fd)
    except (OSError, ValueError, IndexError):
        pass
