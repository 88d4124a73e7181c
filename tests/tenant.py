"""Another local user of this host, played for real: a second uid running code of a test's choosing.

The tests of what a tenant of a shared host can do start the attacker as ``nobody``
(uid 65534), a user that owns nothing of the program's. Switching uid needs root; a test
that uses ``tenant`` is skipped elsewhere with a line that says so. A developer without root
runs these tests in a throwaway VM or container as root (``sudo bash scripts/test.sh -k
tenant``), which is how CI runs them.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import textwrap

import pytest

T = 30.0
"""Bound of every wait here: reaching it is a failure, never a measure of speed."""

OTHER_USER = "nobody"
"""The account that plays the other tenant."""

TENANT_PYTHON = "/usr/bin/python3"
"""The system's interpreter: the tenant cannot read one under root's home (pyenv's)."""


def other_uid() -> int:
    """The other tenant's uid."""
    return pwd.getpwnam(OTHER_USER).pw_uid


def needs_root() -> pytest.MarkDecorator:
    """Skip a test unless this process may switch to another uid."""
    if not os.access(TENANT_PYTHON, os.X_OK):
        return pytest.mark.skip(reason=f"plays another local user with {TENANT_PYTHON}: not found")
    return pytest.mark.skipif(
        os.geteuid() != 0,
        reason="plays another local user (needs root to switch uid): run as root, e.g. sudo",
    )


def as_other_user(
    code: str, *args: str, timeout: float = T, background: bool = False
) -> subprocess.CompletedProcess[str] | subprocess.Popen[str]:
    """Run the Python ``code`` as the other tenant, with ``args`` in ``sys.argv[1:]``.

    The tenant gets a minimal environment (no variable of this run's, no ``TMPDIR`` of the
    suite's) and its own umask 022, as a login would. With ``background`` the started
    process is returned (its stdout and stderr are pipes); otherwise the finished one.
    """
    uid = other_uid()
    gid = pwd.getpwnam(OTHER_USER).pw_gid
    env = {"PATH": "/usr/bin:/bin", "HOME": "/", "LANG": "C.UTF-8"}
    argv = [TENANT_PYTHON, "-I", "-c", textwrap.dedent(code), *args]
    kwargs: dict[str, object] = dict(
        env=env, user=uid, group=gid, extra_groups=[], umask=0o022, cwd="/", text=True
    )
    if background:
        return subprocess.Popen(  # type: ignore[call-overload,no-any-return]
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs
        )
    return subprocess.run(  # type: ignore[call-overload,no-any-return]
        argv, capture_output=True, timeout=timeout, **kwargs
    )
