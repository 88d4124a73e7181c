"""Files, directories and named objects that must be this user's own: opened without following links, owner and mode checked on the open descriptor.

Another local user of a shared host can create names in ``/dev/shm`` or the temp dir
before Fiber does, recreate a name that Fiber removed, or leave a symbolic link where
Fiber writes. What Fiber trusts is therefore checked after it is opened (``fstat`` of
the descriptor, so a rename between a check and the open changes nothing): made by
the expected user, and, for what holds the run's data, closed to everyone else.
"""

from __future__ import annotations

import os
import stat

from fiber_core.base.errors import ForeignObjectError

NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
"""Flags of every open of a name that someone else could have made: never through a link."""


def not_ours(st: os.stat_result, uid: int, private: bool = True) -> str | None:
    """Why a file or directory with status ``st`` must not be trusted by ``uid``, or None.

    ``private``: it must also be closed to the group and others (no permission bits for them).
    """
    if st.st_uid != uid:
        return f"it belongs to uid {st.st_uid}, not {uid}"
    if private and st.st_mode & 0o077:
        return f"its mode {stat.S_IMODE(st.st_mode):04o} lets other users in"
    return None


def check(fd: int, what: str, uid: int | None = None, private: bool = True) -> os.stat_result:
    """The status of the open ``fd``; raises :class:`ForeignObjectError` if :func:`not_ours`
    (``uid``: this process's effective uid unless given)."""
    st = os.fstat(fd)
    why = not_ours(st, os.geteuid() if uid is None else uid, private)
    if why is not None:
        raise ForeignObjectError(f"{what}: {why}")
    return st


def private_dir(path: str) -> int:
    """A descriptor of the directory ``path``, made with mode 0700 unless it exists.

    An existing one is used only if it is this user's and closed to others (checked on a
    descriptor opened without following a link); else :class:`ForeignObjectError`.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW)
    try:
        check(fd, f"{path} is not this user's private directory")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(name: str, flags: int, dir_fd: int, what: str, mode: int = 0o600) -> int:
    """``os.open`` of ``name`` in the directory ``dir_fd`` never through a link, checked as
    this user's private file (:class:`ForeignObjectError` otherwise, the file left open by no one)."""
    fd = os.open(name, flags | NOFOLLOW, mode, dir_fd=dir_fd)
    try:
        check(fd, what)
    except BaseException:
        os.close(fd)
        raise
    return fd
