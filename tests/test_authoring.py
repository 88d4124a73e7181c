"""Writing a backend as the contract says: the recipe, the template, and the suite that proves them.

The recipe in :mod:`fiber_core.contract.backend`'s docstring is copied, as written, to
``tests/authoring/shell_backend.py`` and ``examples/backend_template/fiber_shell.py``;
the copies are checked against the docstring, registered by hand, and run through the
conformance suite. The suite itself is checked to fail at once, with the job's log,
on a backend whose jobs cannot start.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
from authoring import shell_backend

from fiber_core.base.errors import BackendError
from fiber_core.contract import JobSpec
from fiber_core.contract import backend as contract
from fiber_core.runtime.config import config, create_backend, plugins
from fiber_core.testing import BackendConformance

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "examples" / "backend_template"
COPIES = [Path(__file__).parent / "authoring" / "shell_backend.py", TEMPLATE / "fiber_shell.py"]


@pytest.fixture(scope="module", autouse=True)
def _shell_registered() -> None:
    """The recipe's module, registered by hand as a plugin (as an entry point would)."""
    if not plugins().pm.has_plugin("shell"):
        plugins().register_plugin(shell_backend, name="shell")


class TestShellRecipe(BackendConformance):
    backend_name = "shell"


# -- the recipe and its copies ---------------------------------------------------------------


def recipe() -> str:
    """The literal block of the backend contract's docstring that defines ``ShellBackend``."""
    doc = contract.__doc__ or ""
    for block in doc.split("::\n\n")[1:]:
        lines = []
        for line in block.splitlines():
            if line and not line.startswith(" "):
                break
            lines.append(line)
        code = textwrap.dedent("\n".join(lines)).strip("\n") + "\n"
        if "class ShellBackend(Backend):" in code:
            return code
    raise AssertionError("the backend contract's docstring has no ShellBackend recipe")


def without_docstring(path: Path) -> str:
    source = path.read_text()
    first = ast.parse(source).body[0]
    assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant), \
        f"{path} starts with a docstring, then the recipe"
    assert first.end_lineno is not None
    return "\n".join(source.splitlines()[first.end_lineno:]).strip("\n") + "\n"


@pytest.mark.parametrize("path", COPIES, ids=lambda p: p.name)
def test_copy_is_the_recipe_as_written(path: Path) -> None:
    assert without_docstring(path) == recipe(), (
        f"{path} and the recipe in fiber_core/contract/backend.py's docstring differ: "
        "change both together")


def test_shell_option_and_a_missing_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FIBER_SHELL_SHELL", "/nonexistent/sh")
    config.reset()
    backend = create_backend("shell", "t")
    try:
        assert backend.settings["shell"] == "/nonexistent/sh"
        with pytest.raises(BackendError, match="set FIBER_SHELL_SHELL to one that exists"):
            backend.start_job(JobSpec(command=["true"]))
        assert backend.jobs == []
    finally:
        backend.cleanup()


# -- the template, installed as a distribution -------------------------------------------------


@pytest.fixture
def template_installed(tmp_path: Path) -> dict[str, str]:
    """``examples/backend_template`` as pip would install it: its module and a dist-info
    made from its pyproject.toml (name, version, the ``fiber`` entry points)."""
    project = tomllib.loads((TEMPLATE / "pyproject.toml").read_text())["project"]
    site = tmp_path / "site"
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True)
    (site / "fiber_shell.py").write_text((TEMPLATE / "fiber_shell.py").read_text())
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    entry_points = "".join(f"{k} = {v}\n" for k, v in project["entry-points"]["fiber"].items())
    (info / "entry_points.txt").write_text(f"[fiber]\n{entry_points}")
    (info / "top_level.txt").write_text("fiber_shell\n")
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


@pytest.mark.timeout(300)
def test_template_tests_pass_with_its_entry_point(template_installed: dict[str, str],
                                                  tmp_path: Path) -> None:
    # The whole suite already runs above on the same code (the copies are identical): here
    # the template's own test file proves the wiring, entry point to registered backend to
    # a Fiber process on it.
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "installed_and_registered or test_registered or fiber_process_roundtrip",
         str(TEMPLATE / "tests")],
        capture_output=True, text=True, env=template_installed, cwd=tmp_path, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"\b3 passed\b", out.stdout), out.stdout


# -- the suite fails fast, with the log ---------------------------------------------------------

NO_PYTHON = '''
from authoring.shell_backend import ShellBackend
from fiber_core.contract import hookimpl
from fiber_core.runtime.config import plugins
from fiber_core.testing import BackendConformance


class NoPythonBackend(ShellBackend):
    """Jobs, workers included, start an interpreter that does not exist."""

    name = "nopython"

    def worker_command(self):
        return ["/nonexistent/python3"]


class Plugin:
    @hookimpl
    def fiber_register_backends(self, register):
        register(NoPythonBackend)


plugins().register_plugin(Plugin(), name="nopython")


class TestNoPython(BackendConformance):
    backend_name = "nopython"
    python = "/nonexistent/python3"
    start_timeout = 3600.0  # a test that waited for it would hit --timeout, without the log
'''


@pytest.fixture
def no_python_report(tmp_path: Path) -> Iterator[dict[str, str]]:
    """Run the suite on a backend whose jobs cannot start; yield each test's failure text."""
    (tmp_path / "test_nopython.py").write_text(NO_PYTHON)
    report = tmp_path / "report.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "60",
         f"--junitxml={report}", "test_nopython.py"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=540)
    assert report.exists(), out.stdout + out.stderr
    failures = {}
    for case in ET.parse(report).iter("testcase"):
        failure = case.find("failure")
        failures[case.attrib["name"]] = "" if failure is None else (
            failure.attrib.get("message", "") + "\n" + (failure.text or ""))
    yield failures


@pytest.mark.timeout(600)
def test_suite_fails_at_once_with_the_log_of_a_job_that_cannot_start(
        no_python_report: dict[str, str]) -> None:
    suite = sorted(name for name in dir(BackendConformance) if name.startswith("test_"))
    assert sorted(no_python_report) == suite
    assert no_python_report.pop("test_registered") == ""
    # sh's own words for the missing interpreter, as get_job_logs (or the Pool's and the
    # Manager's errors, which quote it) returned them: never a timeout.
    said = "/nonexistent/python3: not found"
    missing = {name: text[-600:] for name, text in no_python_report.items() if said not in text}
    assert not missing, missing


# -- the page that walks through it -------------------------------------------------------------


@pytest.mark.parametrize("page", [REPO / "docs" / "writing-a-backend.md", TEMPLATE / "README.md"],
                         ids=lambda p: p.name)
def test_links_lead_somewhere(page: Path) -> None:
    links = re.findall(r"\]\(([^)#]+)\)", page.read_text())
    assert links
    broken = [link for link in links if not (page.parent / link).exists()]
    assert not broken, f"{page}: links to nothing: {broken}"
