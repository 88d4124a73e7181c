"""Writing a backend as the guide says: its one example file, the template, and the suite.

``docs/writing-a-backend.md`` includes one file as its example backend
(``examples/backend_template/fiber_shell.py``, no copy of it anywhere): the file the guide
names is loaded, registered by hand as the guide's step 2 says, and run through the
conformance suite. The suite itself is checked to fail at once, with the job's log, on a
backend whose jobs cannot start.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from fiber_core.base.errors import BackendError
from fiber_core.contract import JobSpec
from fiber_core.runtime.config import config, create_backend, plugins
from fiber_core.testing import BackendConformance

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "examples" / "backend_template"
GUIDE = REPO / "docs" / "writing-a-backend.md"


def guide_example() -> Path:
    """The file the guide includes as its example backend."""
    found = re.findall(r"```\{literalinclude\} (\S+)", GUIDE.read_text())
    assert len(found) == 1, f"{GUIDE} includes {len(found)} files; it shows one example backend"
    return (GUIDE.parent / found[0]).resolve()


@pytest.fixture(scope="module", autouse=True)
def _shell_registered() -> None:
    """The guide's example module, registered by hand as its step 2 says."""
    if plugins().pm.has_plugin("shell"):
        return
    spec = importlib.util.spec_from_file_location("fiber_shell", guide_example())
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fiber_shell"] = module
    spec.loader.exec_module(module)
    plugins().register_plugin(module, name="shell")


class TestShellRecipe(BackendConformance):
    backend_name = "shell"


# -- the one example file ---------------------------------------------------------------------


def test_the_guide_includes_the_one_example_file_that_the_suite_runs() -> None:
    assert guide_example() == TEMPLATE / "fiber_shell.py"
    assert sys.modules["fiber_shell"].__file__ == str(guide_example())
    needle = "class ShellBackend" + "(Backend):"  # spelt apart, so that this file holds no copy
    copies = [path for path in [*REPO.glob("fiber_core/**/*.py"), *REPO.glob("tests/**/*.py"),
                                *REPO.glob("docs/*.md"), *REPO.glob("examples/**/*.py")]
              if needle in path.read_text() and path != guide_example()]
    assert copies == [], f"copies of the example backend: change the one file instead: {copies}"


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
    # The whole suite already runs above on the same file: here
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
from fiber_shell import ShellBackend
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
        filter(None, [str(TEMPLATE), os.environ.get("PYTHONPATH")]))}
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
