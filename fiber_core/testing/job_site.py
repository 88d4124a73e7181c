"""A directory that gives a job's Python a plugin of this checkout, its dependencies and this tree's fiber_core.

The test image ``fiber-test`` has Python 3.11 and fiber-core only. A test whose job runs a
program that starts jobs itself (``fiber run``'s pod or Batch job) mounts such a directory
in the job and puts it on its ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
from pathlib import Path

CORE = Path(__file__).resolve().parents[1]


def requirements(dist: str) -> list[str]:
    """The names of what ``dist`` requires (its extras left out)."""
    names = []
    for req in importlib.metadata.requires(dist) or []:
        if "extra ==" in req:
            continue
        m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req)
        if m:
            names.append(m.group(0))
    return names


def build_job_site(target: Path, package: Path, dist: str, sdk: str) -> Path:
    """Fill ``target`` with the files of ``sdk`` and everything it requires, copied from this
    (3.11) environment, the plugin ``package`` (a directory of this checkout) with a dist-info
    of ``dist`` holding its entry points, and this tree's fiber_core (the plugin may need what
    the image's, built from another commit, does not have yet); ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    todo = [sdk]
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        try:
            found = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in found.files or []:
            if ".." in f.parts or "__pycache__" in f.parts:
                continue
            src = Path(str(found.locate_file(f)))
            if src.is_file():
                dst = target / f
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
        todo.extend(requirements(name))
    for source in (package, CORE):
        shutil.copytree(source, target / source.name, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    installed = importlib.metadata.distribution(dist)  # installed (editable) for the tests
    info = target / f"{package.name}-{installed.version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {installed.version}\n")
    eps = [ep for ep in installed.entry_points if ep.group == "fiber"]
    (info / "entry_points.txt").write_text("[fiber]\n" + "".join(f"{ep.name} = {ep.value}\n" for ep in eps))
    (info / "top_level.txt").write_text(f"{package.name}\n")
    return target
