"""``get_context()`` and start methods: spawn-like methods accepted, ``fork`` refused clearly."""

from __future__ import annotations

from pathlib import Path

import pytest

import fiber_core

T = 30.0


@pytest.mark.parametrize("refuse", [fiber_core.get_context, fiber_core.set_start_method])
def test_fork_is_refused_with_an_explanation(refuse) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="'fork' is not available") as e:
        refuse("fork")
    assert "fresh interpreter" in str(e.value) and "spawn" in str(e.value)


def test_unknown_method_lists_the_available_ones() -> None:
    with pytest.raises(ValueError, match="spawn"):
        fiber_core.get_context("threads")


def test_methods() -> None:
    assert "fork" not in fiber_core.get_all_start_methods()
    assert fiber_core.get_context().get_start_method() == fiber_core.get_start_method()
    assert fiber_core.get_context("spawn").get_start_method() == "spawn"
    fiber_core.set_start_method("spawn", force=True)
    try:
        assert fiber_core.get_start_method() == "spawn"  # remembered, as the stdlib does
        with pytest.raises(RuntimeError, match="already been set"):
            fiber_core.set_start_method("forkserver")
    finally:
        fiber_core.set_start_method(None, force=True)
    assert fiber_core.get_start_method() == "fiber"


def _put_name(q: fiber_core.Queue) -> None:
    q.put(fiber_core.current_process().name)


@pytest.mark.parametrize("method", [None, "spawn", "forkserver"])
def test_context_factories_run_processes(method: str | None) -> None:
    ctx = fiber_core.get_context(method)
    assert ctx.Process is fiber_core.Process
    q = ctx.Queue()
    p = ctx.Process(target=_put_name, args=(q,), name=f"via-{method}")
    p.start()
    assert q.get(timeout=T) == f"via-{method}"
    p.join(T)
    assert p.exitcode == 0
    assert ctx.current_process().name == "MainProcess" and ctx.parent_process() is None
    assert ctx.active_children() == []
    assert ctx.cpu_count() >= 1


def test_exceptions_are_the_stdlib_ones() -> None:
    import multiprocessing

    for name in ("ProcessError", "BufferTooShort", "TimeoutError", "AuthenticationError"):
        assert getattr(fiber_core, name) is getattr(multiprocessing, name)
        assert getattr(fiber_core.get_context(), name) is getattr(multiprocessing, name)


def test_every_public_name_of_multiprocessing_is_here() -> None:
    import multiprocessing

    assert [n for n in multiprocessing.__all__ if not hasattr(fiber_core, n)] == []
    assert fiber_core.reducer is multiprocessing.reduction
    with pytest.raises(ValueError, match="multiprocessing.reduction.register"):
        fiber_core.get_context().reducer = multiprocessing.reduction
    with pytest.raises(TypeError, match="list of strings"):
        fiber_core.set_forkserver_preload("numpy")
    fiber_core.set_forkserver_preload(["numpy"])  # accepted: no fork server to preload


@pytest.mark.parametrize("kind", [str, bytes, "path"])
def test_set_executable_takes_what_the_stdlib_takes(kind: object, tmp_path) -> None:  # noqa: ANN001
    import os
    import pathlib
    import sys

    # A wrapper of this interpreter that marks its processes, so the test sees the
    # setting used and not the default.
    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text(f'#!/bin/sh\nFIBER_TEST_WRAPPED=yes exec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    value = {str: str(wrapper), bytes: os.fsencode(str(wrapper)), "path": pathlib.Path(wrapper)}[kind]  # type: ignore[index]
    fiber_core.set_executable(value)
    try:
        q = fiber_core.Queue()
        p = fiber_core.Process(target=_put_wrapped, args=(q,))
        p.start()
        assert q.get(timeout=T) == "yes"
        p.join(T)
        assert p.exitcode == 0
    finally:
        fiber_core.init(python=sys.executable)


def _put_wrapped(q) -> None:  # noqa: ANN001
    import os

    q.put(os.environ.get("FIBER_TEST_WRAPPED"))


def test_set_executable_is_refused_for_jobs_that_run_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    pytest.importorskip("fiber_docker")

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "plugins" / "fiber_docker" / "tests"))
    try:
        from docker_service import docker_host
    finally:
        sys.path.pop(0)
    from fiber_core.testing import service_missing

    try:
        host = docker_host()
    except Exception as e:  # noqa: BLE001 - whatever says the daemon is not up
        service_missing(str(e))
    monkeypatch.setenv("DOCKER_HOST", host)
    monkeypatch.setenv("FIBER_BACKEND", "docker")
    monkeypatch.setenv("FIBER_DOCKER_IMAGE", "fiber-test:latest")
    from fiber_core.runtime.config import config

    before = config.get("python")
    with pytest.raises(ValueError, match="docker backend's jobs run elsewhere.*FIBER_PYTHON"):
        fiber_core.set_executable("/nowhere/python")
    assert config.get("python") == before  # nothing set


def test_submodules_are_reachable_as_attributes_without_their_own_import() -> None:
    import subprocess
    import sys

    code = ("import fiber_core as mp; "
            "print(mp.managers.SyncManager.__name__, mp.pool.Pool.__name__, mp.synchronize.Lock.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["SyncManager", "Pool", "Lock"]


def test_importing_the_package_loads_none_of_the_api_until_a_name_is_used(run_script) -> None:  # noqa: ANN001
    # Every job imports fiber_core first: the context, the queues, the Pipe and the process
    # module load when a name that needs them is first used, and "fiber" is a start method
    # name of the stdlib's from the import on.
    out = run_script("""
        import sys, multiprocessing, fiber_core
        print(sorted(m for m in sys.modules if m.startswith('fiber_core')))
        ctx = multiprocessing.get_context('fiber')
        print(ctx is fiber_core.get_context(), 'fiber_core.parallel.queues' in sys.modules)
        print(fiber_core.Queue.__module__, 'Queue' in dir(fiber_core))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "['fiber_core', 'fiber_core.parallel', 'fiber_core.parallel.start_method']",
        "True True",  # the context, with the API behind it, once the name was looked up
        "fiber_core.parallel.queues True",
    ]


def test_every_name_the_package_lists_is_there_and_a_wrong_one_says_so(run_script) -> None:  # noqa: ANN001
    # `from fiber_core import *` gives what `from multiprocessing import *` gives, Pool and
    # Manager included.
    out = run_script("""
        import fiber_core
        missing = [n for n in sorted({*fiber_core.__all__, *dir(fiber_core)}) if not hasattr(fiber_core, n)]
        print(missing)
        from fiber_core import *
        print(Process.__name__, Pool.__name__, Manager.__name__, Lock.__name__, TimeoutError.__module__)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[]", "Process Pool Manager Lock multiprocessing.context"]
    with pytest.raises(AttributeError, match="module 'fiber_core' has no attribute 'Proces'"):
        fiber_core.Proces  # noqa: B018 - the attribute's lookup is the test


def test_the_names_type_checkers_see_are_the_names_the_package_gives() -> None:
    # The package names its API twice: imports under TYPE_CHECKING for type checkers, and
    # the table that __getattr__ loads from. Each name must come from the same module in both.
    import ast

    tree = ast.parse(Path(fiber_core.__file__).read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If)
                 and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
    seen = {alias.asname or alias.name: node.module for node in block.body
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fiber_core.")
            for alias in node.names}
    only_in_annotations = {"StatusServer"}
    assert seen == {**fiber_core._LAZY, **{name: seen[name] for name in only_in_annotations}}
