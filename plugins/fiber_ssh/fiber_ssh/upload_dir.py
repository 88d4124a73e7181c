"""Where an upload lands on a host: a fresh private directory, or the configured one, checked.

The jobs run in the upload directory, and under ``python -m`` it is the first entry of their
``sys.path``: whoever could write in it before or during the upload could run code as the
program. Another user of a shared host can create any directory in its temp dir whose name
they can guess, so the directory the backend makes is never one that exists: a random name,
created with mode 0700 (the host's umask can only take bits away), set to 0700 again, then
checked with ``lstat``: a directory, not a link, ours, 0700. A directory the user configured
(``[ssh] workdir``) may exist, but only as ours and writable by nobody else.

The decisions are pure functions; :func:`prepare` applies them over an SFTP session.
"""

from __future__ import annotations

import os
import stat
from typing import Any

from fiber_core.contract import BackendError

PRIVATE = 0o700
"""The mode of a fresh upload directory."""


def fresh_name(run_id: str) -> str:
    """A new upload directory's name: the run's id for people, 128 random bits against guessing.

    Not ``fiber-*``: the run directories' names, which a later run on a host with the same
    temp dir examines.
    """
    return f"fiberupload-{run_id or 'run'}-{os.urandom(16).hex()}"


def fresh_dir_problem(mode: int, owner: int, uid: int) -> str | None:
    """Why a directory just created for an upload must not be used (None: it may)."""
    if stat.S_ISLNK(mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(mode):
        return "it is not a directory"
    if owner != uid:
        return f"it belongs to uid {owner}, not to the login's uid {uid}"
    if stat.S_IMODE(mode) != PRIVATE:
        return f"its mode is {stat.S_IMODE(mode):04o}, not {PRIVATE:04o}"
    return None


def configured_dir_problem(mode: int, owner: int, uid: int) -> str | None:
    """Why an existing directory named by ``[ssh] workdir`` must not take an upload (None: it
    may): it must be ours, and no one else may write in it (``mode`` as ``stat``, not ``lstat``,
    gives it: a configured path may be a link)."""
    if not stat.S_ISDIR(mode):
        return "it is not a directory"
    if owner != uid:
        return f"it belongs to uid {owner}, not to the login's uid {uid}"
    if stat.S_IMODE(mode) & 0o022:
        return f"others may write in it (mode {stat.S_IMODE(mode):04o}): chmod go-w it"
    return None


def makedirs(sftp: Any, path: str) -> bool:
    """``mkdir -p`` over sftp; return whether the last directory was created."""
    try:
        sftp.stat(path)
        return False
    except OSError:
        pass
    parent = path.rsplit("/", 1)[0]
    if parent and parent != path:
        makedirs(sftp, parent)
    sftp.mkdir(path)
    return True


def make_private(sftp: Any, path: str, uid: int, where: str) -> None:
    """Create ``path`` (which must not exist) as an upload directory only ``uid`` can enter."""
    sftp.mkdir(path, PRIVATE)  # fails if anything is there
    sftp.chmod(path, PRIVATE)  # whatever the server did with the mode
    st = sftp.lstat(path)
    problem = fresh_dir_problem(st.st_mode, st.st_uid, uid)
    if problem:
        raise BackendError(f"the upload directory {where}:{path} cannot be trusted: {problem}; "
                           "check the host's temp directory, or set [ssh] workdir")


def prepare(sftp: Any, path: str, uid: int, configured: bool, where: str) -> bool:
    """Make the upload directory ``path`` ready on the host ``where``; whether it was created.

    A path of the backend's own (``configured`` false) is created, never reused. A configured
    one is used if it exists and is safe, else created (its parents as ``mkdir -p`` does).
    """
    if not configured:
        make_private(sftp, path, uid, where)
        return True
    try:
        sftp.lstat(path)
    except FileNotFoundError:
        parent = path.rsplit("/", 1)[0]
        if parent:
            makedirs(sftp, parent)
        make_private(sftp, path, uid, where)
        return True
    st = sftp.stat(path)  # a configured link is followed: what it leads to is checked
    problem = configured_dir_problem(st.st_mode, st.st_uid, uid)
    if problem:
        raise BackendError(f"the upload directory {where}:{path} ([ssh] workdir) is not safe to "
                           f"upload to: {problem}; fix it or name another")
    return False
