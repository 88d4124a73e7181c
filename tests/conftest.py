"""Shared fixtures of the core tests: isolation, scripts run in a fresh interpreter, a toy backend.

Every test runs real processes on the local backend. ``T`` bounds each wait (a test that
needs it has failed: it is never a measure of speed).

The suite runs with a temp dir of its own (``TMPDIR``), which it must leave without a
``fiber-*`` or ``pymp-*`` entry: a run leaves nothing behind, however it ends. A test
that SIGKILLs a program gives it a temp dir of the test's own (``own_tmpdir``): what a
killed program leaves is removed by the next run (``tests/test_leftovers.py``), not by it.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import fiber_core
from fiber_core.backends.local import LocalBackend
from fiber_core.base.options import Option
from fiber_core.runtime.config import config, plugins
from fiber_core.testing.faults import SEED_VARIABLE

T = 30.0
"""Upper bound of any single wait in the tests."""


LEFTOVER_PREFIXES = ("fiber-", "pymp-")
"""What Fiber's run directories and multiprocessing's temp dirs are named."""


class _SuiteTempdir:
    """The core suite's temp dir: made before its first test, checked after its last one."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.saved: tuple[str | None, str | None] = (None, None)

    def start(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="core-suite-tmp-"))
        self.saved = os.environ.get("TMPDIR"), tempfile.tempdir
        os.environ["TMPDIR"] = tempfile.tempdir = str(self.path)

    def finish(self) -> None:
        """Give the temp dir back; an error naming every run or pymp dir the suite left."""
        private, self.path = self.path, None
        if private is None:
            return
        if self.saved[0] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = self.saved[0]
        tempfile.tempdir = self.saved[1]
        from fiber_core.runtime import run  # this process's own are in use until it exits

        live = {getattr(run._runtime, "_rundir", None),
                multiprocessing.current_process()._config.get("tempdir")}  # type: ignore[attr-defined]
        left = sorted(p for p in private.iterdir() if p.name.startswith(LEFTOVER_PREFIXES) and str(p) not in live)
        if left:
            listing = "\n".join(f"  {p}: {sorted(os.listdir(p)) if p.is_dir() else 'a file'}" for p in left)
            raise AssertionError(f"the core suite left {len(left)} run or multiprocessing temp dir(s) in "
                                 f"its temp dir {private}:\n{listing}")
        mp_tempdir = multiprocessing.current_process()._config.get("tempdir")  # type: ignore[attr-defined]
        if mp_tempdir is not None and Path(mp_tempdir).parent == private:
            # multiprocessing removes its own at exit (and reports it gone if it already is):
            # the rest goes now, the directory itself after multiprocessing's finalizer.
            for entry in private.iterdir():
                if str(entry) == mp_tempdir:
                    continue
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink()
            multiprocessing.util.Finalize(None, shutil.rmtree, args=(private, True), exitpriority=-101)
            return
        shutil.rmtree(private, ignore_errors=True)


_suite_tempdir = _SuiteTempdir()


@pytest.fixture(scope="session", autouse=True)
def _private_tempdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    tmp_path_factory.getbasetemp()  # pytest's own directories stay where they are
    _suite_tempdir.start()
    yield
    _suite_tempdir.finish()


def _is_core(item: pytest.Item) -> bool:
    return Path(__file__).parent in Path(item.path).parents


_LAST_CORE_TEST = pytest.StashKey["pytest.Item | None"]()


def _last_core_test(session: pytest.Session) -> pytest.Item | None:
    """The core suite's last test in this session's order (after deselection)."""
    if _LAST_CORE_TEST not in session.stash:
        session.stash[_LAST_CORE_TEST] = next((i for i in reversed(session.items) if _is_core(i)), None)
    return session.stash[_LAST_CORE_TEST]


@pytest.hookimpl(trylast=True)  # after the test's fixtures are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    # The check ends with the core suite's last test, also when other suites (the plugins')
    # run after it. Not before: where a plugin's tests run between two core files, ending
    # it there would remove the live run directory of this process's runtime (its hub's
    # socket), which the core tests after them still use, and drop the suite's TMPDIR.
    if item is _last_core_test(item.session):
        _suite_tempdir.finish()


@pytest.fixture
def own_tmpdir() -> Iterator[str]:
    """A temp dir for the programs of one test that it kills (SIGKILL): removed after the test."""
    path = tempfile.mkdtemp(prefix="t-")  # short: Unix sockets are made in it
    yield path
    shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A hang must fail its own test quickly instead of eating the suite's budget.
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(60))


@pytest.fixture(autouse=True)
def _isolate(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No FIBER_* variable (but the chaos tests' seed) or .fiberconfig leaks in; no child
    outlives its test."""
    for key in list(os.environ):
        if key.startswith("FIBER_") and key != SEED_VARIABLE:
            monkeypatch.delenv(key)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.chdir(tmp_path)
    config.reset()
    yield
    config.reset()
    for p in fiber_core.active_children():
        p.kill()
        p.join(T)


RunScript = Callable[..., subprocess.CompletedProcess]


@pytest.fixture
def run_script(tmp_path: Path) -> RunScript:
    """Run ``code`` as ``script.py`` in a fresh interpreter; return the completed process."""

    def run(code: str, env: dict[str, str] | None = None, timeout: float = 2 * T) -> subprocess.CompletedProcess:
        path = tmp_path / "script.py"
        path.write_text(textwrap.dedent(code))
        return subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                              env={**os.environ, **(env or {})}, cwd=tmp_path, timeout=timeout)

    return run


# -- a third-party backend -------------------------------------------------------------


class ToyBackend(LocalBackend):
    """The local backend under another name, with options, marking its jobs' environment."""

    name = "toy"
    aliases = ("plaything",)
    package = "fiber-toy"
    options = (
        Option("flavour", str, "plain", "a choice", choices=("plain", "spicy", "sweet")),
        Option("slots", int, 1, "an integer"),
        Option("token", str, None, "a secret", secret=True),
    )

    def create_job(self, spec):  # noqa: ANN001, ANN201
        spec.env["FIBER_TOY_JOB"] = self.settings["flavour"]
        return super().create_job(spec)


class _ToyPlugin:
    @fiber_core.hookimpl
    def fiber_register_backends(self, register):  # noqa: ANN001, ANN201
        register(ToyBackend)


@pytest.fixture(scope="session")
def toy_backend() -> type[ToyBackend]:
    """``ToyBackend``, registered in this process through a pluggy plugin object."""
    if not plugins().pm.has_plugin("toy"):
        plugins().register_plugin(_ToyPlugin(), name="toy")
    plugins().backends()  # load, so that its options are known to the configuration
    return ToyBackend


TOY_MODULE = '''
from fiber_core import hookimpl
from fiber_core.backends.local import LocalBackend


class ToyBackend(LocalBackend):
    name = "toy"
    aliases = ("plaything",)

    def create_job(self, spec):
        spec.env["FIBER_TOY_JOB"] = "yes"
        return super().create_job(spec)


@hookimpl
def fiber_register_backends(register):
    register(ToyBackend)
'''


@pytest.fixture
def toy_dist(tmp_path: Path) -> dict[str, str]:
    """An installed distribution ``fiber-toy`` whose ``fiber`` entry point adds ``toy``.

    Returns the environment (``PYTHONPATH``) under which a fresh interpreter finds it.
    """
    site = tmp_path / "site"
    info = site / "fiber_toy-0.3.dist-info"
    info.mkdir(parents=True)
    (site / "fiber_toy.py").write_text(TOY_MODULE)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fiber-toy\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[fiber]\ntoy = fiber_toy\n")
    (info / "top_level.txt").write_text("fiber_toy\n")
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path}
