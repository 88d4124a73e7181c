"""Run directories in the temp dir: each locked by its living creator, so a later run removes those whose creator died.

A process of a run keeps its files (the hub's socket, job logs, what its jobs on
this machine put in multiprocessing's temp dir) in one private directory, removed
when it exits. A process killed with SIGKILL cannot remove it. So a top-level run
directory holds a file, ``lock``, on which its creator holds an ``flock`` for as
long as it lives (the kernel releases it however the process ends), and
:func:`remove_stale` (called when a run makes its directory) removes each
``fiber-*`` directory whose lock nobody holds any more. A directory in use is never
removed: its lock is held; one being made has no ``lock`` yet (the lock is taken on
another name, then renamed); one without a lock file (made by another program, or
by an older Fiber) is left alone.

A process whose parent's run directory is on this machine makes its own inside it
(:func:`make` with ``inside``): the parent's lock covers it, and the parent's exit
removes it with its own.
"""

from __future__ import annotations

import os
import stat

LOCK = "lock"
"""The file in a top-level run directory whose flock its creator holds."""
PREFIX = "fiber-"
"""What the names of run directories begin with."""

_held: dict[str, int] = {}
"""Run directories this process made, with the descriptor that holds each one's lock."""


def usable(path: str | None) -> str | None:
    """``path`` if it is a directory of this user (not a symbolic link), else None.

    A job is told its parent's run directory; on another machine it does not exist.
    """
    if not path:
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return None
    return path


def make(prefix: str, inside: str | None = None) -> str:
    """A new private directory (mode 0700) named ``prefix`` + random characters.

    Inside ``inside`` (a run directory that its creator's lock covers) as it is; else in
    the temp dir, locked while this process lives. Remove it with :func:`remove`.
    """
    import tempfile  # when a directory is made: a job that makes none starts without it

    if inside is not None:
        return tempfile.mkdtemp(prefix=prefix, dir=inside)
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        import fcntl  # POSIX only, like the rest of Fiber's process handling

        taking = os.path.join(path, f".{LOCK}-new")
        fd = os.open(taking, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.rename(taking, os.path.join(path, LOCK))
        except OSError:
            os.close(fd)
            raise
    except OSError:  # no flock here (some network filesystems): a directory no one else removes
        return path
    _held[path] = fd
    return path


def remove(path: str) -> None:
    """Remove a directory :func:`make` returned, and let go of its lock."""
    import shutil  # at exit, and only if there is a run directory

    shutil.rmtree(path, ignore_errors=True)
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


def remove_stale(tempdir: str | None = None) -> list[str]:
    """Remove the run directories in ``tempdir`` (default: the temp dir) whose creator has
    ended; return their paths. Only this user's, and only those that hold a lock file."""
    import fcntl
    import tempfile

    where = tempdir or tempfile.gettempdir()
    removed: list[str] = []
    try:
        entries = list(os.scandir(where))
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        if not entry.name.startswith(PREFIX) or entry.path in _held:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
                continue
            fd = os.open(os.path.join(entry.path, LOCK), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # gone meanwhile, no lock file (not a run's, or not made yet)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its creator (or a process it forked) lives
            os.close(fd)
            continue
        try:
            import shutil

            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
        finally:
            os.close(fd)
    return removed
