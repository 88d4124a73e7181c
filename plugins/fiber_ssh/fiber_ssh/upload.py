"""Copying this process's working directory to the SSH hosts (the ``upload`` setting), and
removing what was copied at exit."""

from __future__ import annotations

import fnmatch
import logging
import os
import shlex
import stat
from pathlib import Path

from fiber_core.contract import BackendError

from fiber_ssh import upload_dir
from fiber_ssh.connect import Connector, Host, Unreachable

log = logging.getLogger("fiber")

DEFAULT_EXCLUDE = [".git", ".hg", ".svn", "__pycache__", "*.pyc", ".venv", "venv", ".tox",
                   ".mypy_cache", ".pytest_cache", ".ruff_cache", "node_modules", ".fiberconfig"]


def upload(conn: Connector, host: Host) -> None:
    """Copy this process's working directory to the host's workdir (once per host)."""
    import paramiko

    with host.lock:
        if host.uploaded:
            return
        files = _upload_list(Path.cwd(), conn.settings["upload_exclude"] or [])
        total = sum(size for _, _, size in files)
        limit = conn.settings["upload_max_mb"] * 2**20
        if total > limit:
            raise BackendError(
                f"the working directory {Path.cwd()} holds {total / 2**20:.1f} MiB to upload, over "
                f"[ssh] upload_max_mb = {conn.settings['upload_max_mb']:g}; exclude more "
                "([ssh] upload_exclude) or raise the limit"
            )
        target = host.workdir
        assert target is not None
        t = next((x for x in host.transports if x.is_active()), None)
        if t is None:
            raise Unreachable(f"no connection to {host.name} to upload over")
        try:
            sftp = paramiko.SFTPClient.from_transport(t)
            assert sftp is not None
            try:
                home = sftp.normalize(".")
                if not target.startswith("/"):
                    target = f"{home}/{target[2:] if target.startswith('~/') else target}"
                if host.created_dir != target:  # (else this run made it, at an earlier try)
                    created = upload_dir.prepare(sftp, target, (host.info or {})["uid"],
                                                 bool(conn.settings["workdir"]), host.name)
                    if created and not conn.settings["workdir"]:
                        host.created_dir = target  # cleanup() removes it, even if the copy fails
                for rel, path, _ in files:
                    remote = f"{target}/{rel}"
                    if path is None:
                        upload_dir.makedirs(sftp, remote)
                    else:
                        sftp.put(str(path), remote)
                        sftp.chmod(remote, stat.S_IMODE(path.stat().st_mode))
            finally:
                sftp.close()
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise BackendError(f"uploading {Path.cwd()} to {host.name}:{target} failed: check the "
                               "space and permissions there, or [ssh] workdir", cause=e) from None
        host.workdir = target
        host.uploaded = True


def remove_upload(conn: Connector, host: Host) -> None:
    t = next((x for x in host.transports if x.is_active()), None)
    if t is None or not host.created_dir:
        return
    try:
        conn.run(host, t, f"rm -rf -- {shlex.quote(host.created_dir)}")
    except Exception as e:
        log.warning("fiber-ssh: could not remove %s on %s: %s", host.created_dir, host.name, e)


def _excluded(name: str, rel: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(rel, p) for p in patterns)


def _upload_list(root: Path, exclude: list[str]) -> list[tuple[str, Path | None, int]]:
    """(relative path, local path or None for a directory, size) of what upload copies."""
    out: list[tuple[str, Path | None, int]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        base = Path(dirpath)
        rel_base = base.relative_to(root).as_posix()
        keep = []
        for d in sorted(dirnames):
            rel = d if rel_base == "." else f"{rel_base}/{d}"
            if not _excluded(d, rel, exclude) and not (base / d).is_symlink():
                keep.append(d)
                out.append((rel, None, 0))
        dirnames[:] = keep
        for f in sorted(filenames):
            rel = f if rel_base == "." else f"{rel_base}/{f}"
            path = base / f
            if _excluded(f, rel, exclude) or not path.is_file():
                continue
            out.append((rel, path, path.stat().st_size))
    return out
