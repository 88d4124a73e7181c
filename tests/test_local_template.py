"""Local workers forked from the template process: the same jobs as fresh interpreters."""

from __future__ import annotations

import os
import signal
import subprocess
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


def environment(q: fiber_core.Queue) -> None:
    q.put(dict(os.environ))


def test_a_forked_job_has_the_environment_of_its_start_exactly(template: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # The template changes only the variables where the job's environment differs from its
    # own: one the parent removed since the template started must go, one it changed must
    # change, and every other must be the parent's.
    raw = Path(f"/proc/{template}/environ").read_bytes().decode()
    theirs = dict(entry.split("=", 1) for entry in raw.split("\0") if "=" in entry)
    spare = [k for k in sorted(theirs) if not k.startswith(("FIBER_", "PYTHON", "LD_", "PATH", "HOME", "VIRTUAL_ENV"))]
    assert len(spare) >= 2, theirs.keys()  # pytest's PYTEST_CURRENT_TEST at least, and the shell's
    removed, changed = spare[:2]
    monkeypatch.delenv(removed)
    monkeypatch.setenv(changed, theirs[changed] + " and changed")
    monkeypatch.setenv("TEMPLATE_TEST_X", "new")
    q = fiber_core.Queue()
    p = fiber_core.Process(target=environment, args=(q,))
    p.start()
    env = q.get(timeout=T)
    p.join(T)
    assert removed not in env
    assert env[changed] == theirs[changed] + " and changed"
    assert env["TEMPLATE_TEST_X"] == "new"
    assert {k: v for k, v in env.items() if not k.startswith("FIBER_")} == {
        k: v for k, v in os.environ.items() if not k.startswith("FIBER_")}


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


def test_the_template_has_loaded_the_extension_every_job_s_runtime_reads_its_limits_with(template: int) -> None:
    # `resource` reads the descriptor limit when a job's runtime starts: loaded in every job,
    # it cost each one half a millisecond of CPU. The template's mapped files show it loaded.
    import resource

    if "resource" in sys.builtin_module_names or not getattr(resource, "__file__", None):
        pytest.skip("resource is built into this interpreter: nothing to load")
    assert resource.__file__ in Path(f"/proc/{template}/maps").read_text()


def test_the_template_preloads_what_unpickling_locks_imports(template: int) -> None:
    q = fiber_core.Queue()
    p = fiber_core.Process(target=modules_loaded, args=(q, ["fiber_core.parallel.synchronize"]))
    p.start()
    assert q.get(timeout=T) == (template, [True])
    p.join(T)


def test_the_template_imports_cloudpickle_and_the_pipe_once_no_job_was_asked_for_a_while(template: int) -> None:
    # Not before it is ready (the program's first jobs do not wait for it), but a later job has
    # them: cloudpickle, and the parts of the API that `import fiber_core` leaves out.
    from fiber_core.backends.template import LATER_IDLE_SECONDS

    names = ["cloudpickle", "fiber_core.processes.pipe", "fiber_core.parallel.context"]
    q = fiber_core.Queue()
    deadline = time.monotonic() + T
    while True:
        time.sleep(LATER_IDLE_SECONDS)  # the condition itself: no job asked for that long
        p = fiber_core.Process(target=modules_loaded, args=(q, names))
        p.start()
        forked_from, loaded = q.get(timeout=T)
        p.join(T)
        assert forked_from == template and p.exitcode == 0
        if all(loaded) or time.monotonic() > deadline:
            break
    assert loaded == [True, True, True]


def test_a_forked_job_reaches_its_parent_on_its_channel_without_the_hub(
        template: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # The hub serves no process's route: a job that dialed it would be refused (exit code 3).
    hub = runtime().hub
    register = hub.register
    monkeypatch.setattr(hub, "register", lambda target, route: None if target.startswith("proc:")
                        else register(target, route))
    q = fiber_core.Queue()
    p = fiber_core.Process(target=report, args=(q, 0))
    p.start()
    _, ppid, _, _ = q.get(timeout=T)
    p.join(T)
    assert ppid == template and p.exitcode == 0


def test_the_template_takes_requests_sent_back_to_back_each_with_its_descriptors() -> None:
    import json
    import socket

    from fiber_core.backends.template import _recv_requests

    ours, theirs = socket.socketpair()
    pipes = [os.pipe() for _ in range(5)]
    try:
        for i, channel in enumerate([False, True]):
            fds = [pipes[2 * i][1]] + ([pipes[2 * i + 1][1]] if channel else [])
            line = json.dumps({"n": i, "channel": channel}).encode() + b"\n"
            ours.sendmsg([line], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                   b"".join(fd.to_bytes(4, sys.byteorder) for fd in fds))])
        ours.close()
        buf, pending, got = bytearray(), [], []
        while (requests := _recv_requests(theirs, buf, pending)) is not None:
            got += requests
        assert [(r["n"], len(fds)) for r, fds in got] == [(0, 1), (1, 2)]
        for (_, fds), wanted in zip(got, [[0], [2, 3]]):
            for fd, i in zip(fds, wanted):  # each descriptor is the one sent with its request
                os.write(fd, b"x")
                assert os.read(pipes[i][0], 1) == b"x"
                os.close(fd)
    finally:
        theirs.close()
        for r, w in pipes:
            os.close(r)
            os.close(w)


def children_of_self(q: fiber_core.Queue) -> None:
    q.put((os.getppid(), Path(f"/proc/self/task/{os.getpid()}/children").read_text().split()))


def test_a_forked_job_forks_no_watcher_the_template_watches_its_parent(template: int) -> None:
    # (test_parent_death: the job still ends with its parent inside a long C call)
    q = fiber_core.Queue()
    p = fiber_core.Process(target=children_of_self, args=(q,))
    p.start()
    assert q.get(timeout=T) == (template, [])
    p.join(T)


def autogroup_of_self() -> str | None:
    """This process's scheduling autogroup, or None where the kernel gives it none.

    The file is missing without autogroup support, and reads empty where the process's
    group is not an autogroup (inside a container's cgroup, or with autogroup off).
    """
    try:
        fields = Path("/proc/self/autogroup").read_text().split()
    except OSError:
        return None
    return fields[0] if fields else None


def session_of_self(q: fiber_core.Queue) -> None:
    q.put((os.getsid(0), os.getpgid(0), os.getpid(), autogroup_of_self()))


@pytest.mark.skipif(sys.version_info < (3, 11), reason="3.10 starts the template in a session of its own")
def test_a_forked_job_shares_the_parent_s_session_and_so_its_scheduling_group(template: int) -> None:
    # Where the kernel groups a session's processes for the scheduler (autogroup), jobs in
    # another session would share their CPUs with the parent as a group, not as its peers.
    q = fiber_core.Queue()
    p = fiber_core.Process(target=session_of_self, args=(q,))
    p.start()
    sid, pgid, pid, autogroup = q.get(timeout=T)
    p.join(T)
    assert sid == os.getsid(0)
    assert pgid == pid  # still a process group of its own: stopped as one, no terminal's Ctrl-C
    if autogroup is not None:
        assert autogroup == autogroup_of_self()


def test_a_forked_job_has_no_controlling_terminal_where_the_program_has_one(run_script) -> None:  # noqa: ANN001
    # The program runs as a terminal's session (pty.fork). A job that could open the
    # terminal from a process group of its own would be stopped by reading it (SIGTTIN).
    out = run_script("""
        import errno, os, sys
        import fiber_core

        def probe(q):
            try:
                os.close(os.open("/dev/tty", os.O_RDWR))
                q.put("opened")
            except OSError as e:
                q.put(errno.errorcode[e.errno])

        def program():
            os.close(os.open("/dev/tty", os.O_RDWR))  # this program has a terminal
            q = fiber_core.Queue()
            p = fiber_core.Process(target=probe, args=(q,))
            p.start()
            print("job:", q.get(timeout=60), flush=True)
            p.join(60)
            print("exitcode:", p.exitcode, flush=True)

        if __name__ == "__main__":
            import pty
            pid, fd = pty.fork()
            if pid == 0:
                program()
                sys.exit(0)
            out = b""
            while True:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:  # EIO: the terminal's last holder is gone
                    break
                if not chunk:
                    break
                out += chunk
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            print(out.decode(errors="replace").replace("\\r", ""), "program:", code)
    """, env={"FIBER_BACKEND": "local"})
    assert out.returncode == 0, out.stderr
    assert "job: ENXIO" in out.stdout and "exitcode: 0" in out.stdout, out.stdout
    assert out.stdout.rstrip().endswith("program: 0"), out.stdout


def test_the_run_starts_the_template_when_it_selects_the_local_backend(run_script) -> None:  # noqa: ANN001
    # The hub's start selects the backend: the template is on its way before any job is asked for.
    out = run_script("""
        import fiber_core
        from fiber_core.runtime.run import runtime

        if __name__ == "__main__":
            runtime().hub
            backend = runtime().backend
            print(backend._template is not None and backend.jobs == [], backend.wait_template(30))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


def test_the_template_starts_before_the_plugins_load_and_is_the_one_jobs_fork_from(run_script) -> None:  # noqa: ANN001
    # Nothing configured: the local backend is likely, so its template imports while this
    # process loads the plugins (which could still detect another backend).
    out = run_script("""
        import sys
        from fiber_core.backends import template
        from fiber_core.runtime.run import runtime

        started = []
        start = template.Template.__init__

        def recorded(self, *args, **kwargs):
            started.append("fiber_core.runtime.registry" in sys.modules)
            start(self, *args, **kwargs)
            started.append(self)

        template.Template.__init__ = recorded

        if __name__ == "__main__":
            backend = runtime().backend
            print(backend.name, started[0], len(started), backend._template is started[1],
                  backend.wait_template(30))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["local", "False", "2", "True", "True"]


def test_a_lock_made_for_jobs_starts_the_template_and_a_bad_backend_waits_for_a_job(run_script) -> None:  # noqa: ANN001
    # As multiprocessing starts its resource tracker when a lock is made, the run chooses its
    # backend then; a backend that cannot be chosen is reported where a job starts, not here.
    out = run_script("""
        import fiber_core
        from fiber_core.runtime.run import runtime

        if __name__ == "__main__":
            lock = fiber_core.Lock()
            print(runtime()._selected is not None and runtime().backend.wait_template(30))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"]
    out = run_script("""
        import fiber_core

        if __name__ == "__main__":
            lock = fiber_core.Lock()
            print("made")
            fiber_core.Process(target=print).start()
    """, env={"FIBER_BACKEND": "no-such-backend"})
    assert out.stdout.split() == ["made"]
    assert out.returncode == 1 and "no-such-backend" in out.stderr


def test_a_program_s_first_pool_forks_every_worker_from_the_template_that_is_starting(run_script) -> None:  # noqa: ANN001
    # The template starts when the Pool chooses the backend, so its workers are asked for while
    # it imports: they wait for it rather than start as new interpreters beside it.
    out = run_script("""
        import os
        from pathlib import Path
        import fiber_core
        from fiber_core.runtime.run import runtime

        def parent_pid(_):
            return int(Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()[1])

        if __name__ == "__main__":
            with fiber_core.Pool(3) as pool:
                parents = set(pool.map(parent_pid, range(30), chunksize=1))
            print(parents == {runtime().backend._template._popen.pid})
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"]


@pytest.mark.parametrize("settings", [{"FIBER_BACKEND": "local", "FIBER_LOCAL_PRELOAD": "json"},
                                      {"FIBER_LOCAL_START": "fresh"}])
def test_a_template_starts_early_only_as_the_local_backend_s_settings_say(run_script, settings) -> None:  # noqa: ANN001
    out = run_script("""
        import os
        from fiber_core.backends import template
        from fiber_core.runtime.run import runtime

        if __name__ == "__main__":
            backend = runtime().backend
            held = backend._template
            print(held is None if os.environ.get("FIBER_LOCAL_START") == "fresh"
                  else held.wait_ready(30) and held._popen.args[-1] == "json")
    """, env=settings)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"]


def test_the_template_starts_before_the_program_imports_the_contract_and_the_plugins(run_script) -> None:  # noqa: ANN001
    # The template's start is what a program's first job waits for: it starts as soon as the
    # first primitive is made, before the backend contract, pluggy and the plugins' entry points
    # (15-20 ms) are imported, and imports meanwhile.
    out = run_script("""
        import sys
        before = set(sys.modules)  # what the interpreter's own start imported (site, .pth files)
        from fiber_core.backends import template

        seen = []
        start = template.Template.__init__

        def spy(self, *args, **kwargs):
            late = {"fiber_core.contract.backend", "fiber_core.backends.local", "pluggy", "importlib.metadata"}
            seen.append(sorted(late & (set(sys.modules) - before)))
            start(self, *args, **kwargs)

        template.Template.__init__ = spy
        import fiber_core

        if __name__ == "__main__":
            fiber_core.Queue()
            print(seen)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[[]]"]


def test_the_run_starts_no_template_where_jobs_start_as_new_interpreters(run_script) -> None:  # noqa: ANN001
    out = run_script("""
        import fiber_core
        from fiber_core.runtime.run import runtime

        if __name__ == "__main__":
            fiber_core.init(local_start="fresh")
            runtime().hub
            print(runtime().backend._template is None)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"]


def test_the_template_starts_without_typing() -> None:
    # What the template imports before it forks (its own module and PRELOAD) leaves typing
    # out: 2-3 ms of every program's first template, which its first jobs wait for.
    from fiber_core.backends.template import PRELOAD

    code = (f"import sys, importlib; [importlib.import_module(m) for m in {['fiber_core.backends.template', *PRELOAD]!r}]; "
            "print(sorted({'typing', 'dataclasses', 'inspect'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(Path(fiber_core.__file__).parents[1])})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]"]
