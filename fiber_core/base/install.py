"""How to install the project's distributions: here, on another host, or in a container image.

The project publishes a backend per platform as a distribution of its own
(:data:`KNOWN_BACKENDS`). Each hint names the command that installs one from where this
fiber-core came from (a checkout, a directory of wheels, an index): for a backend asked for
and not installed (:func:`install_command`), for a host or an image that lacks Fiber
(:func:`install_elsewhere`).
"""

from __future__ import annotations

import importlib.metadata
import json
import shlex
import urllib.parse
from collections.abc import Sequence
from pathlib import Path

KNOWN_BACKENDS = {
    "docker": "fiber-docker",
    "kubernetes": "fiber-k8s",
    "ssh": "fiber-ssh",
    "aws-batch": "fiber-aws",
}
"""The backends the project publishes, by name, with the distribution of each."""

KNOWN_PACKAGES = {**KNOWN_BACKENDS, "k8s": "fiber-k8s", "aws": "fiber-aws"}
"""The same by every name they answer to, for the hint of an unknown name."""

CHECKOUT = Path(__file__).resolve().parents[2]
"""The directory that holds this ``fiber_core``: a checkout of the project when it is run from one."""


def install_command(package: str) -> str:
    """The command that installs ``package``, one of the project's distributions, beside this fiber-core.

    Where fiber-core was installed from decides: from a checkout (editable or not), the
    plugin's directory in it; from a wheel or sdist in a directory that holds the plugin's too,
    that directory as ``--find-links``; otherwise (an index) the name.
    """
    folder = package.replace("-", "_")
    checkouts = [CHECKOUT]
    source = _core_source()
    if source is not None and source.is_dir():
        checkouts.append(source)
    for root in checkouts:
        if (root / "plugins" / folder / "pyproject.toml").is_file():
            return f"pip install {_shown(root / 'plugins' / folder)}"
    if source is not None and source.is_file():
        wheelhouse = source.parent
        if any(wheelhouse.glob(f"{folder}-*.whl")) or any(wheelhouse.glob(f"{folder}-*.tar.gz")):
            return f"pip install --find-links {_shown(wheelhouse)} {package}"
    return f"pip install {package}"


DIST_DIR = "fiber-dist"
"""The directory the remote install hints have ``scripts/build-dists.sh`` build the wheels into."""
IMAGE_DIST_DIR = "/tmp/fiber"
"""Where the Dockerfile lines of :func:`install_elsewhere` copy those wheels in an image."""


def install_elsewhere(packages: Sequence[str] = ("fiber-core",), python: str = "python3",
                      image: bool = False) -> str:
    """How to install the project's distributions ``packages`` where this machine's paths do not
    exist: on another host (``python -m pip``), or in a container image (Dockerfile lines).

    The same source as :func:`install_command`: from a checkout, the wheels that its
    ``scripts/build-dists.sh`` builds; from a directory of wheels, a copy of it; otherwise (an
    index) the names, at the version of this fiber-core.
    """
    source = _core_source()
    wheelhouse = source.parent if source is not None and source.is_file() else None
    checkouts = [CHECKOUT, *([source] if source is not None and source.is_dir() else [])]
    checkout = next((root for root in checkouts if (root / "scripts" / "build-dists.sh").is_file()), None)
    names = " ".join(packages)
    into = f"<build context>/{DIST_DIR}" if image else DIST_DIR
    made = None
    if checkout is not None:
        made = f"build the wheels: bash {_shown(checkout / 'scripts' / 'build-dists.sh')} {into}"
    elif wheelhouse is not None:
        made = f"copy the wheels of {_shown(wheelhouse)} to {into}"
    if made is not None:
        if image:
            return (f"{made}, then in the Dockerfile: COPY {DIST_DIR}/ {IMAGE_DIST_DIR}/ and RUN pip "
                    f"install --find-links {IMAGE_DIST_DIR} {names}")
        return (f"{made} here, copy {DIST_DIR} to the host, and there run: {python} -m pip install "
                f"--find-links {DIST_DIR} {names}")
    version = installed_version("fiber-core")
    pinned = " ".join(f"{n}=={version}" if n == "fiber-core" and version else n for n in packages)
    return f"in the Dockerfile: RUN pip install {pinned}" if image else f"{python} -m pip install {pinned}"


def _core_source() -> Path | None:
    """The local directory or file fiber-core was installed from (pip's ``direct_url.json``)."""
    try:
        text = importlib.metadata.distribution("fiber-core").read_text("direct_url.json")
        url = urllib.parse.urlparse(json.loads(text)["url"]) if text else None
    except (importlib.metadata.PackageNotFoundError, ValueError, KeyError, TypeError):
        return None
    if url is None or url.scheme != "file":
        return None
    from urllib.request import url2pathname  # here only: it loads ssl and http.client (8 ms)

    return Path(url2pathname(url.path))


def _shown(path: Path) -> str:
    """``path`` as a command line shows it: ``./plugins/fiber_k8s`` under the current directory."""
    try:
        cwd = Path.cwd()
        shown = f"./{path.relative_to(cwd)}" if cwd != Path(cwd.anchor) else str(path)
    except (ValueError, OSError):  # elsewhere, or no current directory
        shown = str(path)
    return shlex.quote(shown)


def installed_version(package: str) -> str | None:
    """The version of the distribution ``package`` in this environment, or None."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
