"""Local workers forked from the template process: the same jobs as fresh interpreters."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

import fiber_core
from fiber_core.runtime.run import runtime

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def report(q: fiber_core.Queue, code: int) -> None:
    print("to the log", flush=True)
    q.put((os.getpid(), os.getppid(), sys.modules["__main__"].__name__, os.environ.get("TEMPLATE_TEST_X")))
    sys.exit(code)


def wait_forever(q: fiber_core.Queue) -> None:
    q.put(os.getpid())
    time.sleep(600)


@pytest.fixture
def template() -> int:
    """The pid of this run's template, ready."""
    backend = runtime().backend
    assert backend.wait_template(T)
    return backend._template._popen.pid


def test_a_forked_job_is_a_job_as_any(template: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEMPLATE_TEST_X", "set after the template started")
    q = fiber_core.Queue()
    p = fiber_core.Process(target=report, args=(q, 3))
    p.start()
    pid, ppid, main, x = q.get(timeout=T)
    p.join(T)
    assert pid == p.pid and ppid == template  # forked from the template, not from this process
    assert p.exitcode == 3
    assert x == "set after the template started"  # the environment of the job's start, not the template's
    assert "to the log" in p._run.backend.get_job_logs(p._run.job)


@pytest.mark.parametrize("how, code", [("terminate", -signal.SIGTERM), ("kill", -signal.SIGKILL)])
def test_a_forked_job_is_stopped_with_its_group(template: int, how: str, code: int) -> None:
    q = fiber_core.Queue()
    p = fiber_core.Process(target=wait_forever, args=(q,))
    p.start()
    assert parent_of(q.get(timeout=T)) == template
    getattr(p, how)()
    p.join(T)
    assert p.exitcode == code


def test_jobs_start_fresh_when_the_template_is_gone(template: int, caplog: pytest.LogCaptureFixture) -> None:
    q = fiber_core.Queue()
    running = fiber_core.Process(target=wait_forever, args=(q,))
    running.start()
    assert parent_of(q.get(timeout=T)) == template
    os.kill(template, signal.SIGKILL)
    running.join(T)  # its end cannot be known any more: it is ended as lost
    assert running.exitcode == -signal.SIGKILL
    p = fiber_core.Process(target=report, args=(q, 0))
    p.start()
    pid, ppid, _, _ = q.get(timeout=T)
    p.join(T)
    assert ppid == os.getpid() and p.exitcode == 0  # a new interpreter, child of this process
    assert "local jobs start as new interpreters" in caplog.text


def modules_loaded(q: fiber_core.Queue, names: list[str]) -> None:
    q.put((os.getppid(), [name in sys.modules for name in names]))


def test_the_template_preloads_what_pool_workers_import(template: int) -> None:
    # Forked from the template, a job has the worker's and the Pool's modules already (a
    # pool worker would otherwise import the Pool's first: about half of its start).
    q = fiber_core.Queue()
    p = fiber_core.Process(target=modules_loaded,
                           args=(q, ["fiber_core.processes.worker", "fiber_core.parallel.pool"]))
    p.start()
    assert q.get(timeout=T) == (template, [True, True])  # forked from the template, both there
    p.join(T)
