"""The main module compiled once in the parent: which code a job runs, and when it compiles."""

from __future__ import annotations

import marshal
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fiber_core.processes import main_code

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed


def run(code: str, namespace: dict | None = None) -> dict:
    namespace = {} if namespace is None else namespace
    exec(code, namespace)  # noqa: S102 - the code under test
    return namespace


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(main_code, "_cache", None)


def test_a_job_runs_the_parents_code_for_the_same_source_and_compiles_any_other(tmp_path: Path) -> None:
    path = tmp_path / "app.py"
    path.write_text("X = 'from the file'\n")
    shipped = main_code.compiled(("path", str(path)))
    assert shipped is not None
    source = path.read_bytes()
    assert run(main_code.code_for(source, str(path), shipped))["X"] == "from the file"
    # What runs is the shipped code itself, not a compile of the job's file: a shipment that
    # names the same source but carries other code shows which one ran.
    other = (shipped[0], shipped[1], marshal.dumps(compile("X = 'shipped'", str(path), "exec")))
    assert run(main_code.code_for(source, str(path), other))["X"] == "shipped"
    # Another source (the job's copy differs), another interpreter, or nothing shipped: the
    # job's own file, compiled there.
    assert run(main_code.code_for(b"X = 'edited'\n", str(path), other))["X"] == "edited"
    for tag in (("cpython-30", b"\0\0\r\n", 0), (*main_code.TAG[:2], main_code.TAG[2] + 1)):
        # another version, or the same run with -O (whose code has no asserts): compiled here
        elsewhere = (tag, shipped[1], other[2])
        assert run(main_code.code_for(source, str(path), elsewhere))["X"] == "from the file"
    assert run(main_code.code_for(source, str(path), None))["X"] == "from the file"


def test_the_parent_compiles_again_only_when_the_file_changed(tmp_path: Path) -> None:
    path = tmp_path / "app.py"
    path.write_text("X = 1\n")
    first = main_code.compiled(("path", str(path)))
    assert main_code.compiled(("path", str(path))) is first
    path.write_text("X = 22\n")
    second = main_code.compiled(("path", str(path)))
    assert second is not None and second is not first and second[1] != first[1]
    assert run(marshal.loads(second[2]))["X"] == 22


def test_nothing_is_shipped_where_the_job_must_say_why_or_the_code_is_too_big(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n")
    assert main_code.compiled(("path", str(bad))) is None  # the job compiles it, and reports the error
    assert main_code.compiled(("path", str(tmp_path / "missing.py"))) is None
    zipped = tmp_path / "app.pyz"
    zipped.write_bytes(b"PK")
    assert main_code.compiled(("path", str(zipped))) is None  # run by runpy in the job, as before
    assert main_code.compiled(("name", "app")) is None  # imported by name: it has its own .pyc
    assert main_code.compiled(None) is None  # no main module file (python -c, a notebook)
    big = tmp_path / "big.py"
    big.write_text("X = 1\n")
    monkeypatch.setattr(main_code, "MAX_BYTES", 10)
    assert main_code.compiled(("path", str(big))) is None


# The jobs report every compile of the program's file through an audit hook that
# sitecustomize installs in each interpreter (builtins.compile raises "compile").
SITECUSTOMIZE = """
    import os, sys

    def _hook(event, args):
        if event == "compile" and isinstance(args[1], str) and args[1].endswith("script.py"):
            with open(os.environ["COMPILE_LOG"], "a") as f:
                f.write(f"{os.getpid()}\\n")

    sys.addaudithook(_hook)
"""

SCRIPT = """
    import os, sys
    import fiber_core

    VERSION = "old"

    def report(q):
        q.put((os.getpid(), VERSION))

    def start():
        q = fiber_core.Queue()
        p = fiber_core.Process(target=report, args=(q,))
        p.start()
        out = q.get(timeout=30)
        p.join(30)
        return out

    if __name__ == "__main__":
        pid, version = start()
        print(pid, version, os.getpid())
        if sys.argv[1:] == ["edit"]:
            # The same size and modification time: the parent keeps its code, whose digest
            # no longer matches the file the next job reads.
            st = os.stat(__file__)
            with open(__file__, "r+") as f:
                text = f.read()
                f.seek(0)
                f.write(text.replace('VERSION = "old"', 'VERSION = "new"'))
            os.utime(__file__, ns=(st.st_atime_ns, st.st_mtime_ns))
            pid, version = start()
            print(pid, version, os.getpid())
"""


@pytest.mark.parametrize("start", ["template", "fresh"])
def test_a_job_imports_the_main_module_without_compiling_it(tmp_path: Path, start: str) -> None:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(textwrap.dedent(SITECUSTOMIZE))
    (tmp_path / "script.py").write_text(textwrap.dedent(SCRIPT))
    log = tmp_path / "compiles"
    env = {**os.environ, "FIBER_LOCAL_START": start, "COMPILE_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "script.py"], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=2 * T)
    assert out.returncode == 0, out.stderr
    pid, version, parent = out.stdout.split()
    assert version == "old"  # the main module ran in the job
    assert set(log.read_text().split()) == {parent}  # (the hook sees each compile: the parent's)


def test_a_job_whose_file_differs_from_the_parents_runs_its_own(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(textwrap.dedent(SCRIPT))
    out = subprocess.run([sys.executable, "script.py", "edit"], capture_output=True, text=True,
                         cwd=tmp_path, env={**os.environ, "FIBER_LOCAL_START": "fresh"}, timeout=2 * T)
    assert out.returncode == 0, out.stderr
    assert [line.split()[1] for line in out.stdout.splitlines()] == ["old", "new"]
