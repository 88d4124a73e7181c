"""CPython's multiprocessing test suite, imported so that its ``multiprocessing`` is Fiber.

Importing this module imports ``test._test_multiprocessing`` (the suite CPython ships)
and installs its test classes here, as CPython's ``test_multiprocessing_spawn`` does.
Every process of a run imports it: the process that runs a class, and each child,
which unpickles its target (``cpython_tests.WithProcessesTestQueue._test_get``, ...)
by reference.

``CPYTHON_SUITE_IMPL`` says which ``multiprocessing`` the suite sees: ``fiber``
(the default, so a job on any backend needs nothing passed) or ``stdlib`` (the
reference run). For Fiber, the suite's module gets its own ``__import__``: an
``import multiprocessing...`` written in the suite, at import time or inside a test,
gives ``fiber_core`` and its submodules (``connection``, ``managers``, ``pool``,
``process``, ``queues``, ... whichever ``fiber_core`` has when this runs). Nothing
else is redirected: the standard library and Fiber itself keep seeing the real
``multiprocessing``. Three things make the suite importable and its fixtures run, and
are listed in :data:`adjustments`:

* a public name of ``multiprocessing`` that Fiber lacks (``Lock``, ``Value``, ...)
  stands, while the suite is imported, for a callable that raises the
  ``AttributeError`` the missing name would, so the mixins that capture these names
  can be defined and each test that uses one fails on its own;
* a submodule Fiber does not provide (``util``, ``heap``, ``dummy``, ``reduction``,
  ``sharedctypes``, ...) is the standard library's, set as an attribute of
  ``fiber_core`` in this process;
* the private bookkeeping of ``multiprocessing.process`` that CPython's fixtures read
  (``_dangling``, ``_cleanup``) gets an empty stand-in where Fiber lacks it, and
  ``fiber_core.process`` is imported (the stdlib's package always has ``process``).
"""

from __future__ import annotations

import builtins
import importlib
import importlib.util
import os
import sys
import traceback
import types
import unittest
import weakref
from collections.abc import Callable
from typing import Any

IMPL_VAR = "CPYTHON_SUITE_IMPL"
START_METHOD_VAR = "CPYTHON_SUITE_START_METHOD"
SUITE = "test._test_multiprocessing"
IMPLS = ("fiber", "stdlib")

impl = os.environ.get(IMPL_VAR, "fiber")
if impl not in IMPLS:
    raise ValueError(f"{IMPL_VAR}={impl!r}: expected one of {', '.join(IMPLS)}")
start_method = os.environ.get(START_METHOD_VAR, "spawn")
TIMEOUT_VAR = "CPYTHON_SUITE_TIMEOUT"


def _cap_support_timeouts() -> None:
    """Cap the suite's waits at ``CPYTHON_SUITE_TIMEOUT`` seconds, as regrtest's ``--timeout`` does.

    CPython's test runner lowers ``support.SHORT_TIMEOUT``, ``LONG_TIMEOUT`` and the
    others to its per-test timeout, so a test that waits for something that never
    comes fails with its own assertion instead of outliving the runner. The runner here
    passes a cap below its hang limit, for Fiber and the stdlib alike.
    """
    cap = os.environ.get(TIMEOUT_VAR)
    if not cap:
        return
    from test import support

    for name in ("LOOPBACK_TIMEOUT", "INTERNET_TIMEOUT", "SHORT_TIMEOUT", "LONG_TIMEOUT"):
        setattr(support, name, min(getattr(support, name), float(cap)))


_cap_support_timeouts()

adjustments: dict[str, list[str]] = {"missing": [], "lent": [], "stand-ins": []}
"""What this process did to import the suite for Fiber (see the module's docstring)."""

notes: list[str] = []
"""Failures of CPython's module fixtures, which this module then ran step by step."""


class Missing:
    """A name ``fiber_core`` lacks, captured by the suite at import: using it fails the test."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise AttributeError(f"module 'fiber_core' has no attribute {self.name!r}")

    def __repr__(self) -> str:
        return f"<missing fiber_core.{self.name}>"


def _fiber_has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(f"fiber_core.{name}") is not None
    except ImportError:
        return False


def _lend(name: str) -> None:
    """Give ``fiber_core`` the stdlib's submodule ``name`` where Fiber has none."""
    import fiber_core

    if name in vars(fiber_core) or _fiber_has_module(name):
        return
    try:
        module = importlib.import_module(f"multiprocessing.{name}")
    except ImportError:
        return  # not a submodule: ``from multiprocessing import X`` fails as it would
    setattr(fiber_core, name, module)
    adjustments["lent"].append(name)


def _resolve(name: str) -> types.ModuleType:
    """The module ``import multiprocessing.a.b`` means for Fiber."""
    import fiber_core

    if name == "multiprocessing":
        return fiber_core
    sub = name.split(".", 1)[1]
    if _fiber_has_module(sub.split(".")[0]):
        return importlib.import_module(f"fiber_core.{sub}")
    _lend(sub.split(".")[0])
    return importlib.import_module(name)


def _fiber_import(name: str, globals: Any = None, locals: Any = None,
                  fromlist: Any = (), level: int = 0) -> Any:
    """``__import__`` of the suite's module: ``multiprocessing`` means ``fiber_core``."""
    if level or not (name == "multiprocessing" or name.startswith("multiprocessing.")):
        return builtins.__import__(name, globals, locals, fromlist, level)
    module = _resolve(name)
    if not fromlist:
        import fiber_core

        return fiber_core
    if name == "multiprocessing":
        for item in fromlist:
            if item != "*" and not hasattr(module, item):
                _lend(item)
    return module


def _source() -> str:
    """Where ``test/_test_multiprocessing.py`` is: this Python's, else one on ``sys.path``.

    A container whose Python has no test suite finds the parent's through the parent's
    ``sys.path`` (which Fiber appends) and a mount of its ``test`` directory; it then uses
    that whole ``test`` package, since the suite needs the ``test.support`` of its version.
    """
    try:
        spec = importlib.util.find_spec(SUITE)
    except ImportError:
        spec = None
    if spec is not None and spec.origin:
        return spec.origin
    for entry in sys.path:
        path = os.path.join(entry or ".", "test", "_test_multiprocessing.py")
        if os.path.isfile(path):
            for key in [k for k in sys.modules if k == "test" or k.startswith("test.")]:
                del sys.modules[key]
            sys.path.insert(0, entry)
            importlib.invalidate_caches()
            return path
    raise ImportError(f"no {SUITE} in this Python or on sys.path: install its test suite "
                      "(Debian: libpython3-testsuite) or mount it where the parent has it")


def _load() -> types.ModuleType:
    """Import the suite under its own name, for Fiber with a redirecting ``__import__``."""
    loaded = sys.modules.get(SUITE)
    if loaded is not None:
        return loaded
    path = _source()
    spec = importlib.util.spec_from_file_location(SUITE, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    placeholders: list[str] = []
    if impl == "fiber":
        import multiprocessing

        import fiber_core

        module.__dict__["__builtins__"] = {**vars(builtins), "__import__": _fiber_import}
        for name in multiprocessing.__all__:
            if not hasattr(fiber_core, name):
                setattr(fiber_core, name, Missing(name))
                placeholders.append(name)
        adjustments["missing"] = list(placeholders)
    import test

    sys.modules[SUITE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[SUITE]
        raise
    finally:
        if placeholders:
            import fiber_core

            for name in placeholders:
                delattr(fiber_core, name)
    test._test_multiprocessing = module  # type: ignore[attr-defined]
    if impl == "fiber":
        _stand_in_process_bookkeeping()
    return module


def _stand_in_process_bookkeeping() -> None:
    import fiber_core

    if "process" not in vars(fiber_core):
        # The stdlib's package always has ``multiprocessing.process`` (its ``__init__``
        # loads it); CPython's fixtures read it, so it is imported here.
        adjustments["stand-ins"].append("import fiber_core.process")
    process = importlib.import_module("fiber_core.process")
    if not hasattr(process, "_dangling"):
        setattr(process, "_dangling", weakref.WeakSet())  # noqa: B010 - not a name Fiber declares
        adjustments["stand-ins"].append("process._dangling")
    if not hasattr(process, "_cleanup"):
        setattr(process, "_cleanup", lambda: None)  # noqa: B010
        adjustments["stand-ins"].append("process._cleanup")


def _first_line(exc: BaseException) -> str:
    return traceback.format_exception_only(type(exc), exc)[-1].strip().splitlines()[0]


_fell_back: list[str] = []


def _tolerant(what: str, original: Callable[[], None], steps: list[Callable[[], Any]],
              after: str | None = None) -> Callable[[], None]:
    """Run CPython's module fixture; if it fails, note why and run its steps one by one.

    With ``after``, the original is skipped when that fixture fell back: CPython's
    ``tearDownModule`` reads what its ``setUpModule`` saved.
    """

    def fixture() -> None:
        if after not in _fell_back:
            try:
                original()
                return
            except unittest.SkipTest:
                raise
            except Exception as e:
                notes.append(f"{what}: {_first_line(e)}")
        _fell_back.append(what)
        for step in steps:
            try:
                step()
            except Exception as e:
                notes.append(f"{what} step {step.__name__}: {_first_line(e)}")

    return fixture


suite = _load()
suite.install_tests_in_module_dict(globals(), start_method)

SHARED_TMP_VAR = "CPYTHON_SUITE_SHARED_TMP"


def _share_temp_dir() -> None:
    """Put the suite's own temporary directory under ``CPYTHON_SUITE_SHARED_TMP``.

    The suite makes its ``AF_UNIX`` listeners there (``util.get_temp_dir()``); a job in a
    container can reach them only when that directory is mounted into it, which the
    runner does for Docker. Fiber's own run directory stays where it is.
    """
    shared = os.environ.get(SHARED_TMP_VAR)
    if not shared:
        return
    import multiprocessing.process
    import shutil
    import tempfile

    util = suite.util
    config = multiprocessing.process.current_process()._config  # type: ignore[attr-defined]

    def get_temp_dir() -> str:
        tempdir = config.get("tempdir")
        if tempdir is None:
            tempdir = tempfile.mkdtemp(prefix="pymp-", dir=shared)
            util.Finalize(None, shutil.rmtree, args=(tempdir, True), exitpriority=-100)
            config["tempdir"] = tempdir
        return tempdir

    util.get_temp_dir = get_temp_dir
    adjustments["stand-ins"].append(f"util.get_temp_dir under {SHARED_TMP_VAR}")


_share_temp_dir()


def _set_start_method() -> None:
    suite.multiprocessing.set_start_method(start_method, force=True)


def _get_temp_dir() -> None:
    suite.util.get_temp_dir()


def _set_log_level() -> None:
    suite.multiprocessing.get_logger().setLevel(suite.LOG_LEVEL)


def _cleanup_tests() -> None:
    suite.util._cleanup_tests()


setUpModule = _tolerant("setUpModule", globals()["setUpModule"],  # noqa: N816 - unittest's name
                        [_set_start_method, _get_temp_dir, _set_log_level])
tearDownModule = _tolerant("tearDownModule", globals()["tearDownModule"],  # noqa: N816
                           [_cleanup_tests], after="setUpModule")
