"""File descriptors: the limit raised at start, the error that names it, waits that work past 1024.

A parent holds a few descriptors per job (its connections, a sentinel), so the common
soft limit of 1,024 would cap a run at a few hundred workers. Like other servers, a
Fiber process raises its soft limit toward the hard one when it starts
(:func:`raise_limit`); where even that is reached, the error says which limit and how
to raise it (:func:`limit_error`). Descriptors then go past ``FD_SETSIZE``, where
``select.select`` fails: waits on one descriptor use :func:`readable` (``poll``).
"""

from __future__ import annotations

import errno
import select
import socket

CAP = 1 << 20
"""The soft limit is raised to the hard limit, or to this where the hard one is higher."""

OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})


def limits() -> tuple[int, int]:
    """This process's (soft, hard) limits on open descriptors; -1 where unknown."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return -1, -1
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def raise_limit() -> tuple[int, int]:
    """Raise the soft limit on open descriptors toward the hard one; returns (before, after)."""
    try:
        import resource
    except ImportError:
        return -1, -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = CAP if hard == resource.RLIM_INFINITY else min(hard, CAP)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError):
            return soft, soft
        return soft, target
    return soft, soft


def limit_error(error: OSError, what: str = "") -> OSError:
    """``error`` (EMFILE or ENFILE) as an error that names the limit and what to do;
    ``what`` failed (its message starts with it when given)."""
    what = f"{what}: " if what else ""
    soft, hard = limits()
    if error.errno == errno.ENFILE:
        message = (f"{what}the system is out of file descriptors (ENFILE): its limit "
                   "(/proc/sys/fs/file-max) is reached; close other programs or raise it")
    else:
        at_hard = ", which only root can raise" if 0 <= hard <= soft else ""
        message = (f"{what}this process is out of file descriptors: its limit is {soft} "
                   f"(ulimit -n; the hard limit is {hard}{at_hard}). Fiber holds about "
                   "3 per worker here: raise the limit (ulimit -n before starting the program, "
                   "or resource.setrlimit(resource.RLIMIT_NOFILE, ...)) or start fewer")
    out = OSError(error.errno, message)
    out.__cause__ = error
    return out


def readable(sock: socket.socket | int, timeout: float = 0.0) -> bool:
    """Whether ``sock`` has data or an end to read within ``timeout`` seconds, for any descriptor."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(max(0, int(timeout * 1000))))
