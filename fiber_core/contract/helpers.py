"""What the code of many backends needs besides the contract's classes: exit codes from
shell statuses, names a platform accepts, a job's environment and its secrets,
and removing many things at exit."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from fiber_core.base.options import parse_pairs
from fiber_core.contract.env import SECRET_VARIABLES

__all__ = ["clean_name", "exitcode_from_status", "job_environment", "remove_all", "split_secrets"]


def exitcode_from_status(status: int | None) -> int | None:
    """Map a shell-style status (``128 + N`` for signal ``N``) to ``multiprocessing``'s ``-N``."""
    if status is not None and 128 < status < 128 + 65:
        return -(status - 128)
    return status


def clean_name(text: str, allowed: str = "A-Za-z0-9_.-", *, sub: str = "-", limit: int | None = None,
               lower: bool = False, edges: str = "-_.", fallback: str = "job") -> str:
    """``text`` as a name the platform accepts: each run of characters outside ``allowed``
    (a regular-expression class body) becomes ``sub``, ``edges`` are stripped from both ends,
    at most ``limit`` characters; ``fallback`` when nothing is left."""
    out = re.sub(f"[^{allowed}]+", sub, text.lower() if lower else text).strip(edges)
    if limit is not None:
        out = out[:limit].strip(edges)
    return out or fallback


def job_environment(env: Mapping[str, str], extra_env: Iterable[str] | None, where: str) -> dict[str, str]:
    """A job's environment: the ``extra_env`` setting's ``KEY=VALUE`` entries, then ``env``
    (the spec's) over them. A bad entry is a :class:`~fiber_core.base.errors.ConfigError` naming ``where`` it is set."""
    out = parse_pairs(extra_env, f"extra_env in {where}") if extra_env else {}
    out.update(env)
    return out


def split_secrets(env: Mapping[str, str], marked: Iterable[str] = ()) -> tuple[dict[str, str], dict[str, str]]:
    """``env`` as (what may be shown, the secrets): the secrets are the
    :data:`~fiber_core.contract.env.SECRET_VARIABLES` and the names ``marked`` (a job's
    ``JobSpec.secret_env``).

    A backend puts the second part where only the job can read it (a Kubernetes Secret, the
    job's stdin, an SSM parameter), never in what others can list or inspect.
    """
    hidden = SECRET_VARIABLES.union(marked)
    public = {k: v for k, v in env.items() if k not in hidden}
    return public, {k: v for k, v in env.items() if k in hidden}


def remove_all(items: Sequence[Any], remove: Callable[[Any], None], limit: int = 16) -> list[Exception]:
    """Call ``remove(item)`` for every item, ``limit`` at a time; return the errors.

    For removing many platform objects at exit (containers, pods, jobs): in threads while
    threads can start, else (at interpreter exit on Python 3.12, where :meth:`Backend.cleanup`
    runs from atexit) one after another.
    """
    left = list(items)
    lock = threading.Lock()
    errors: list[Exception] = []

    def drain() -> None:
        while True:
            with lock:
                if not left:
                    return
                item = left.pop()
            try:
                remove(item)
            except Exception as e:
                errors.append(e)

    threads = []
    for _ in range(min(limit, len(left)) - 1):
        t = threading.Thread(target=drain, daemon=True, name="fiber-remove")
        try:
            t.start()
        except RuntimeError:
            break
        threads.append(t)
    drain()
    for t in threads:
        t.join()
    return errors
