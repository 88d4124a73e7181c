"""Test helpers shipped with fiber-core: the backend conformance suite.

A backend plugin proves itself with::

    from fiber_core.testing import BackendConformance

    class TestDocker(BackendConformance):
        backend_name = "docker"
        python = "python3"      # the interpreter inside the jobs
        start_timeout = 120.0   # the bound of each wait

``docs/writing-a-backend.md`` walks through writing a backend and proving it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # jobs import this package (targets): it stays light
    from collections.abc import Mapping
    from pathlib import Path

__all__ = ["BackendConformance", "START_ONE", "failing_program", "glance", "service_missing"]


def service_missing(reason: str) -> None:
    """Skip a test whose real service is not up, or fail it under CI (``CI`` set).

    CI starts every service first, so a missing one there is a broken run, not a
    reason for tests to pass without testing anything.
    """
    import os  # imported by jobs: keep it light

    import pytest  # only in test processes: job images often lack pytest

    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: the services must be up)")
    pytest.skip(reason)


def glance(stderr: str, script: str, above: int = 1) -> str:
    """Check that a program's failure reads at a glance; return its error line.

    ``stderr`` is what ``python script`` printed when it ended with an exception. Its
    traceback must start with the script's own frame (at most ``above`` lines above it: the
    ``Traceback`` header), chain no other exception ("The above exception was the direct
    cause", "During handling of the above exception"), and end with the error, on one line.
    A backend's tests assert what that line says (the fix first, then the cause's summary).
    """
    lines = stderr.rstrip().splitlines()
    frame = next((i for i, line in enumerate(lines) if line.strip().startswith(f'File "{script}"')), None)
    if frame is None or frame > above:
        raise AssertionError(f"the script's own frame is not within the first {above + 1} lines:\n{stderr}")
    for chained in ("The above exception was the direct cause", "During handling of the above exception"):
        if chained in stderr:
            raise AssertionError(f"a chained exception is printed ({chained!r}):\n{stderr}")
    if not lines[-1] or lines[-1].startswith(" "):
        raise AssertionError(f"stderr does not end with the error on one line:\n{stderr}")
    return lines[-1]


START_ONE = "fiber_core.Process(target=abs, args=(1,)).start()"
"""The main block of the smallest program that starts a job on the selected backend."""


def failing_program(directory: str | Path, env: Mapping[str, str], body: str = START_ONE,
                    timeout: float = 60.0) -> tuple[str, str]:
    """Run ``app.py``, a program whose main block is ``body``, in ``directory`` in a fresh
    interpreter with ``env`` (``FIBER_BACKEND=docker python app.py``, as a user would); it
    must end with an exception that reads at a glance (:func:`glance`). Return its error
    line and its whole stderr."""
    import subprocess  # test processes only
    import sys
    from pathlib import Path

    script = Path(directory) / "app.py"
    script.write_text(f"import fiber_core\n\nif __name__ == '__main__':\n    {body}\n")
    out = subprocess.run([sys.executable, str(script)], env=dict(env), cwd=directory,
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode != 1:
        raise AssertionError(f"the program ended with {out.returncode}, not with an exception:\n{out.stderr}")
    return glance(out.stderr, str(script)), out.stderr


def __getattr__(name: str) -> Any:
    # Imported on demand: jobs import fiber_core.testing.targets without pytest.
    if name == "BackendConformance":
        from fiber_core.testing.conformance import (
            BackendConformance,  # pytest: only in test processes
        )

        return BackendConformance
    raise AttributeError(name)
