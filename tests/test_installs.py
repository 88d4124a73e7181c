"""Installing Fiber as a user does: the five distributions built, then fresh venvs with the plugins added one at a time."""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

pytestmark = [pytest.mark.installs, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parent.parent
VERSION = "0.1.0"
DISTS = ("fiber-core", "fiber-docker", "fiber-k8s", "fiber-ssh", "fiber-aws")
BACKENDS = {"fiber-docker": "docker", "fiber-k8s": "kubernetes", "fiber-ssh": "ssh", "fiber-aws": "aws-batch"}
# fiber-k8s before fiber-aws and after it: kubernetes and botocore disagree on python-dateutil.
ORDERS = [
    ("fiber-k8s", "fiber-aws", "fiber-docker", "fiber-ssh"),
    ("fiber-ssh", "fiber-docker", "fiber-aws", "fiber-k8s"),
]
PIP_TIMEOUT = 600.0
T = 60.0


def stem(dist: str) -> str:
    return dist.replace("-", "_")


@pytest.fixture(scope="session")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheels and sdists of scripts/build-dists.sh: those of scripts/test.sh, else built here."""
    given = os.environ.get("TEST_DISTS_DIR")
    if given and list(Path(given).glob("fiber_*.whl")):
        return Path(given)
    for tool in ("build", "twine"):
        if importlib.util.find_spec(tool) is None:
            pytest.skip(f"{tool} is not installed (requirements-test.txt)")
    out = tmp_path_factory.mktemp("dists")
    done = subprocess.run(["bash", str(ROOT / "scripts/build-dists.sh"), str(out)], capture_output=True,
                          text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=PIP_TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"10 files in {out}" in done.stdout
    return out


def wheel(dists: Path, dist: str) -> Path:
    return dists / f"{stem(dist)}-{VERSION}-py3-none-any.whl"


def clean_env() -> dict[str, str]:
    """This environment without what would make a venv see the checkout or this run's settings."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("FIBER_", "PYTHON", "VIRTUAL_ENV")) and k != "TEST_DISTS_DIR"}


def run(cmd: list[str], cwd: Path, timeout: float = T) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=clean_env(), timeout=timeout)


def pip(venv: Path, *args: str) -> subprocess.CompletedProcess:
    done = run([str(venv / "bin/python"), "-m", "pip", *args], venv.parent, PIP_TIMEOUT)
    assert done.returncode == 0, f"pip {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done


def backends(venv: Path) -> tuple[dict[str, list[str]], dict[str, str]]:
    """What `fiber backends` says: the installed backends' rows by name, and for each of the
    others the command that installs it."""
    done = run([str(venv / "bin/fiber"), "backends"], venv.parent)
    assert done.returncode == 0, done.stderr
    installed, _, others = done.stdout.partition("\n\n")
    rows = {line.split()[0]: line.split() for line in installed.splitlines()[1:]}
    hints = {line.split()[0]: line.split(None, 2)[2] for line in others.splitlines()[2:]}
    return rows, hints


def test_every_distribution_builds_with_current_metadata(dists: Path) -> None:
    for dist in DISTS:
        whl = wheel(dists, dist)
        sdist = dists / f"{stem(dist)}-{VERSION}.tar.gz"
        assert whl.is_file() and sdist.is_file(), sorted(p.name for p in dists.iterdir())
        info = f"{stem(dist)}-{VERSION}.dist-info"
        with zipfile.ZipFile(whl) as z:
            meta = Parser().parsestr(z.read(f"{info}/METADATA").decode())
            assert f"{info}/licenses/LICENSE" in z.namelist()
        assert meta["Name"] == dist
        assert meta["Requires-Python"] == ">=3.10"  # no upper bound: 3.14 and later install
        assert meta["License-Expression"] == "Apache-2.0"
        assert meta["License"] is None  # the deprecated free-text field
        assert meta.get_all("License-File") == ["LICENSE"]
        with tarfile.open(sdist) as t:
            names = t.getnames()
        for name in ("LICENSE", "README.md", "pyproject.toml"):
            assert f"{stem(dist)}-{VERSION}/{name}" in names
    with zipfile.ZipFile(wheel(dists, "fiber-k8s")) as z:
        assert "fiber_k8s/rbac.yaml" in z.namelist()
        meta = Parser().parsestr(z.read(f"fiber_k8s-{VERSION}.dist-info/METADATA").decode())
    assert any(r.startswith("python-dateutil") and "<3" in r for r in meta.get_all("Requires-Dist"))


@pytest.mark.parametrize("order", ORDERS, ids=["k8s-first", "aws-before-k8s"])
def test_plugins_one_at_a_time(order: tuple[str, ...], dists: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    done = run([sys.executable, "-m", "venv", str(venv)], tmp_path, PIP_TIMEOUT)
    assert done.returncode == 0, done.stderr
    pip(venv, "install", str(wheel(dists, "fiber-core")))
    installed, hints = backends(venv)
    assert set(installed) == {"local"}
    # fiber-core came from a wheel beside the plugins' wheels: `fiber backends` says to take them there.
    assert hints == {name: f"pip install --find-links {dists} {dist}" for dist, name in BACKENDS.items()}
    missing = run([str(venv / "bin/fiber"), "run", "--help"], tmp_path)
    assert (missing.returncode, missing.stdout) == (2, "")
    assert missing.stderr.startswith("fiber: error: `fiber run` comes with fiber-k8s or fiber-aws, neither of which is "
                                     "available here")
    for n, dist in enumerate(order, 1):
        if n == 1:  # the first one as `fiber backends` said
            pip(venv, *shlex.split(hints[BACKENDS[dist]])[1:])
        else:
            pip(venv, "install", str(wheel(dists, dist)))
        # Each step leaves a consistent environment, not only the last one.
        check = run([str(venv / "bin/python"), "-m", "pip", "check"], tmp_path)
        assert check.returncode == 0, f"after {', '.join(order[:n])}:\n{check.stdout}{check.stderr}"
    installed, hints = backends(venv)
    assert set(installed) == {"local", *BACKENDS.values()} and hints == {}
    for dist, name in BACKENDS.items():
        assert installed[name][-2:] == [dist, VERSION]
