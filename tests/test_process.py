"""``fiber_core.Process`` on the local backend: lifecycle, exit codes, identity, bad input."""

from __future__ import annotations

import gc
import multiprocessing.connection
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from procs import alive

import fiber_core
from fiber_core.base.errors import BackendError, PicklingError

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed


def _exit_with(code: object) -> None:
    sys.exit(code)


def _raise() -> None:
    raise RuntimeError("boom")


def _wait_forever(q: fiber_core.Queue, ignore_term: bool = False) -> None:
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    q.put(os.getpid())
    threading.Event().wait()


def _get_one(q: fiber_core.Queue) -> None:
    q.get()


def _report_identity(q: fiber_core.Queue) -> None:
    me, parent = fiber_core.current_process(), fiber_core.parent_process()
    q.put((me.name, me.daemon, os.getpid(), parent.name, parent.pid))


def _start_grandchild(q: fiber_core.Queue) -> None:
    p = fiber_core.Process(target=_report_identity, args=(q,))
    p.start()
    p.join()
    q.put(("exitcode", p.exitcode))


def _start_from_daemon(q: fiber_core.Queue) -> None:
    try:
        fiber_core.Process(target=_exit_with, args=(0,)).start()
    except AssertionError as e:
        q.put(str(e))


def started(*args: object, **kwargs: object) -> fiber_core.Process:
    p = fiber_core.Process(*args, **kwargs)
    p.start()
    return p


def running(q: fiber_core.Queue, **kwargs: object) -> fiber_core.Process:
    """A started child that is known to be running (it has put its pid on ``q``)."""
    p = started(target=_wait_forever, args=(q,), **kwargs)
    assert q.get(timeout=T) == p.pid
    return p


# -- exit codes ----------------------------------------------------------------------


@pytest.mark.parametrize("target, args, code", [
    (_exit_with, (None,), 0),
    (_exit_with, (0,), 0),
    (_exit_with, (7,), 7),
    (_exit_with, ("a message",), 1),
    (_raise, (), 1),
], ids=["return", "exit-0", "exit-7", "exit-msg", "exception"])
def test_exitcode(target: object, args: tuple, code: int) -> None:
    p = fiber_core.Process(target=target, args=args)
    assert p.exitcode is None and not p.is_alive()
    p.start()
    p.join(T)
    assert p.exitcode == code
    assert not p.is_alive()


def test_terminate() -> None:
    p = running(fiber_core.Queue())
    p.terminate()
    p.join(T)
    assert p.exitcode == -signal.SIGTERM


def test_kill_when_sigterm_is_ignored() -> None:
    q = fiber_core.Queue()
    p = started(target=_wait_forever, args=(q, True))
    assert q.get(timeout=T) == p.pid
    p.kill()
    p.join(T)
    assert p.exitcode == -signal.SIGKILL


def test_terminate_before_the_job_reached_its_parent() -> None:
    p = started(target=_wait_forever, args=(fiber_core.Queue(),))
    p.terminate()
    p.join(T)
    assert p.exitcode == -signal.SIGTERM


def test_terminate_twice_and_after_exit() -> None:
    p = running(fiber_core.Queue())
    p.terminate()
    p.terminate()
    p.join(T)
    assert p.exitcode == -signal.SIGTERM
    p.terminate()
    p.kill()
    assert p.exitcode == -signal.SIGTERM


def test_join_timeout_on_running_process() -> None:
    q = fiber_core.Queue()
    p = started(target=_get_one, args=(q,))
    p.join(0.05)
    assert p.is_alive() and p.exitcode is None
    assert p in fiber_core.active_children()
    q.put("go")
    p.join(T)
    assert not p.is_alive() and p.exitcode == 0
    assert p not in fiber_core.active_children()


def test_sentinel_becomes_readable_at_exit() -> None:
    q = fiber_core.Queue()
    p = started(target=_get_one, args=(q,))
    assert multiprocessing.connection.wait([p.sentinel], 0) == []
    q.put("go")
    assert multiprocessing.connection.wait([p.sentinel], T) == [p.sentinel]
    assert fiber_core.wire.framing.wait([p.sentinel], 0) == [p.sentinel]
    p.join(T)
    assert p.exitcode == 0


def test_close() -> None:
    q = fiber_core.Queue()
    p = started(target=_get_one, args=(q,))
    with pytest.raises(ValueError, match="still running"):
        p.close()
    q.put("go")
    p.join(T)
    p.close()
    p.close()
    for use in (p.join, p.is_alive, p.start, p.terminate, p.kill,
                lambda: p.exitcode, lambda: p.pid, lambda: p.sentinel):
        with pytest.raises(ValueError, match="closed"):
            use()


def test_the_process_says_whether_it_connected_and_can_be_joined_and_what_its_log_ends_with() -> None:
    q = fiber_core.Queue()
    p = fiber_core.Process(target=_get_one, args=(q,))
    assert (p.connected(), p.joinable(), p.log_tail(), p.job_logs()) == (False, False, "", "")
    p.start()
    q.put("go")
    p.join(T)
    assert p.exitcode == 0 and p.connected() and p.joinable()
    p.close()
    assert not p.joinable()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_finished_processes_release_their_descriptors() -> None:
    first = started(target=_exit_with, args=(0,))  # what the run keeps (hub, the local template)
    first.join(T)
    del first
    gc.collect()
    before = _open_fds()
    ps = [started(target=_exit_with, args=(0,)) for _ in range(5)]
    for p in ps:
        p.join(T)
    del ps, p
    deadline = time.monotonic() + T
    while _open_fds() > before and time.monotonic() < deadline:
        gc.collect()  # monitor threads may still be ending: poll, bounded by the deadline
        time.sleep(0.01)
    assert _open_fds() <= before


def test_start_twice() -> None:
    p = started(target=_exit_with, args=(0,))
    with pytest.raises(AssertionError, match="twice"):
        p.start()
    p.join(T)
    with pytest.raises(AssertionError, match="twice"):
        p.start()


def test_join_before_start() -> None:
    with pytest.raises(AssertionError, match="started"):
        fiber_core.Process(target=_exit_with, args=(0,)).join()


# -- identity ------------------------------------------------------------------------


def test_pid_name_daemon_seen_by_child() -> None:
    q = fiber_core.Queue()
    p = fiber_core.Process(target=_report_identity, args=(q,))
    assert p.pid is None
    assert re.fullmatch(r"Process-\d+", p.name) and p.daemon is False
    p.start()
    assert q.get(timeout=T) == (p.name, False, p.pid, "MainProcess", os.getpid())
    p.join(T)
    assert p.exitcode == 0


def test_custom_name_and_daemon() -> None:
    q = fiber_core.Queue()
    p = fiber_core.Process(target=_report_identity, args=(q,), name="worker-a", daemon=True)
    assert p.name == "worker-a" and p.daemon
    p.start()
    name, daemon, pid, _, _ = q.get(timeout=T)
    assert (name, daemon, pid) == ("worker-a", True, p.pid)
    p.join(T)


def test_default_names_count_up() -> None:
    a, b = fiber_core.Process(), fiber_core.Process()
    na, nb = (int(p.name.split("-")[1]) for p in (a, b))
    assert nb == na + 1


def test_daemon_cannot_have_children() -> None:
    q = fiber_core.Queue()
    p = started(target=_start_from_daemon, args=(q,), daemon=True)
    assert "daemonic" in q.get(timeout=T)
    p.join(T)
    assert p.exitcode == 0


def test_current_and_parent_process_in_main() -> None:
    assert fiber_core.current_process().name == "MainProcess"
    assert fiber_core.parent_process() is None


def test_active_children() -> None:
    q = fiber_core.Queue()
    ps = [running(q) for _ in range(2)]
    assert set(ps) <= set(fiber_core.active_children())
    for p in ps:
        p.terminate()
        p.join(T)
    assert not set(ps) & set(fiber_core.active_children())


def test_grandchild() -> None:
    q = fiber_core.Queue()
    p = started(target=_start_grandchild, args=(q,))
    name, _, pid, parent_name, parent_pid = q.get(timeout=T)
    assert name == f"{p.name}:1"
    assert (parent_name, parent_pid) == (p.name, p.pid)
    assert pid not in (p.pid, os.getpid())
    assert q.get(timeout=T) == ("exitcode", 0)
    p.join(T)
    assert p.exitcode == 0


# -- what can run ----------------------------------------------------------------------


class Squarer(fiber_core.Process):
    def __init__(self, q: fiber_core.Queue, x: int) -> None:
        super().__init__()
        self.q, self.x = q, x

    def run(self) -> None:
        self.q.put((fiber_core.current_process().name, self.x * self.x))


def test_subclass_overriding_run() -> None:
    q = fiber_core.Queue()
    p = Squarer(q, 9)
    assert re.fullmatch(r"Squarer-\d+", p.name)
    p.start()
    assert q.get(timeout=T) == (p.name, 81)
    p.join(T)
    assert p.exitcode == 0


def test_lambda_and_closure_targets() -> None:
    q = fiber_core.Queue()
    offset = 100

    def closure(x: int) -> None:
        q.put(x + offset)

    ps = [started(target=lambda: q.put("from lambda")), started(target=closure, args=(1,))]
    assert {q.get(timeout=T), q.get(timeout=T)} == {"from lambda", 101}
    for p in ps:
        p.join(T)
        assert p.exitcode == 0


def test_function_defined_in_main(run_script) -> None:  # noqa: ANN001
    out = run_script("""
        import fiber_core

        FACTOR = 3

        def triple(q, x):
            q.put(x * FACTOR)

        if __name__ == "__main__":
            q = fiber_core.Queue()
            p = fiber_core.Process(target=triple, args=(q, 14))
            p.start()
            print("result", q.get(timeout=30))
            p.join()
            print("exitcode", p.exitcode)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["result 42", "exitcode 0"]


def test_stdlib_program_runs_unchanged(run_script) -> None:  # noqa: ANN001
    out = run_script("""
        import fiber_core as multiprocessing

        def square(q, x):
            q.put((x, x * x))

        def echo(conn):
            conn.send(("echo", conn.recv(), multiprocessing.current_process().name))
            conn.close()

        if __name__ == "__main__":
            q = multiprocessing.Queue()
            procs = [multiprocessing.Process(target=square, args=(q, i)) for i in range(3)]
            for p in procs:
                p.start()
            print(sorted(q.get() for _ in procs))
            for p in procs:
                p.join()
            print([p.exitcode for p in procs])
            parent, child = multiprocessing.Pipe()
            p = multiprocessing.Process(target=echo, args=(child,), name="echoer")
            p.start()
            parent.send("hi")
            print(parent.recv())
            p.join()
            print(multiprocessing.current_process().name, multiprocessing.active_children())
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "[(0, 0), (1, 1), (2, 4)]",
        "[0, 0, 0]",
        "('echo', 'hi', 'echoer')",
        "MainProcess []",
    ]


def test_at_exit_daemons_are_terminated_and_others_joined(run_script) -> None:  # noqa: ANN001
    out = run_script("""
        import threading, fiber_core

        def forever(q):
            q.put("up")
            threading.Event().wait()

        def finish(q):
            q.get()
            print("finished")

        if __name__ == "__main__":
            q, go = fiber_core.Queue(), fiber_core.Queue()
            d = fiber_core.Process(target=forever, args=(q,), daemon=True)
            d.start()
            q.get()
            print("daemon", d.pid, flush=True)
            fiber_core.Process(target=finish, args=(go,), name="last").start()
            go.put("go")
    """)
    assert out.returncode == 0, out.stderr
    assert "[last] finished" in out.stdout
    pid = int(out.stdout.split("daemon ")[1].split()[0])
    assert not alive(pid)



# -- bad input: an immediate, clear error -----------------------------------------------


def test_unpicklable_argument_fails_at_start() -> None:
    p = fiber_core.Process(target=_exit_with, args=(threading.Lock(),))
    with pytest.raises(PicklingError, match="lock"):
        p.start()
    assert not p.is_alive() and p.exitcode is None
    assert p not in fiber_core.active_children()


def test_unpicklable_target_fails_at_start() -> None:
    lock = threading.Lock()
    with pytest.raises(PicklingError):
        fiber_core.Process(target=lambda: lock.acquire()).start()


def test_missing_python_fails_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FIBER_PYTHON", "/nonexistent/python")
    p = fiber_core.Process(target=_exit_with, args=(0,))
    with pytest.raises(BackendError, match="/nonexistent/python"):
        p.start()
    assert not p.is_alive() and p not in fiber_core.active_children()


def test_worker_dying_before_connecting(monkeypatch, tmp_path, caplog) -> None:  # noqa: ANN001
    wrapper = tmp_path / "broken-python"
    wrapper.write_text("#!/bin/sh\necho wrapper is broken >&2\nexit 1\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("FIBER_PYTHON", str(wrapper))
    p = started(target=_exit_with, args=(0,))
    p.join(T)
    assert not p.is_alive()
    assert p.exitcode == 1
    assert "before it started" in caplog.text and "wrapper is broken" in caplog.text


def test_worker_never_connecting_fails_after_start_timeout(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    wrapper = tmp_path / "stuck-python"
    wrapper.write_text("#!/bin/sh\nexec sleep 600\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("FIBER_PYTHON", str(wrapper))
    monkeypatch.setenv("FIBER_START_TIMEOUT", "0.5")
    p = started(target=_exit_with, args=(0,))
    p.join(T)
    assert not p.is_alive()
    assert p.exitcode not in (0, None)


def test_unknown_process_option() -> None:
    with pytest.raises(TypeError, match="colour"):
        fiber_core.Process(target=_exit_with, colour="red")



def test_what_main_defines_travels_by_value_when_main_cannot_be_imported() -> None:
    # A program read from stdin has no file the job could import: a class, a function
    # and a dict holding them must be sent by value, not by name.
    code = textwrap.dedent("""
        import fiber_core

        class Point:
            def __init__(self, x):
                self.x = x

        def double(p):
            return Point(p.x * 2)

        def work(q, box):
            q.put(box["fn"](box["point"]).x)

        if __name__ == "__main__":
            q = fiber_core.Queue()
            p = fiber_core.Process(target=work, args=(q, {"fn": double, "point": Point(21)}))
            p.start()
            print("result", q.get(timeout=30))
            p.join(30)
            print("exitcode", p.exitcode)
    """)
    out = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True,
                         timeout=2 * T)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["result 42", "exitcode 0"], out.stderr


def test_what_main_defines_is_the_jobs_own_when_it_imported_main(run_script) -> None:  # noqa: ANN001
    # As under spawn: the job's copy of the main module provides the function and the
    # class (so isinstance holds there), and cloudpickle is not even loaded.
    out = run_script("""
        import sys
        import fiber_core

        class Point:
            pass

        def check(q, p):
            main = sys.modules["__main__"]
            q.put((type(p) is main.Point, check is main.check, "cloudpickle" in sys.modules))

        if __name__ == "__main__":
            q = fiber_core.Queue()
            p = fiber_core.Process(target=check, args=(q, Point()))
            p.start()
            print(q.get(timeout=30))
            p.join(30)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["(True, True, False)"]


def test_a_main_function_redefined_in_the_main_block_is_the_one_sent(run_script) -> None:  # noqa: ANN001
    out = run_script("""
        import fiber_core

        def scale(x):
            return x * 2

        class Greeter:
            def hello(self):
                return "top-level"

        def run(q, fn, cls):
            q.put((fn(10), cls().hello()))

        if __name__ == "__main__":
            def scale(x):  # noqa: F811
                return x * 3

            def run(q, fn, cls):  # noqa: F811  (the target, too, is the redefined one)
                q.put((fn(100), cls().hello()))

            class Greeter:  # noqa: F811
                def hello(self):
                    return "main block"

            q = fiber_core.Queue()
            p = fiber_core.Process(target=run, args=(q, scale, Greeter))
            p.start()
            print(q.get(timeout=30))
            p.join(30)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["(300, 'main block')"]


def _start_thread_setting(evt, release) -> None:  # noqa: ANN001
    def later() -> None:
        release.wait(T)
        evt.set()

    threading.Thread(target=later).start()  # not a daemon: the job must wait for it


def test_job_waits_for_its_non_daemon_threads() -> None:
    evt, release = fiber_core.Event(), fiber_core.Event()
    p = fiber_core.Process(target=_start_thread_setting, args=(evt, release))
    p.start()
    p.join(0.5)
    assert p.is_alive(), "the job ended while its thread was still running"
    release.set()
    p.join(T)
    assert p.exitcode == 0 and evt.is_set()


def _break_stream(evt, name: str, action: str) -> None:  # noqa: ANN001
    import io

    stream = None
    if action == "close":
        stream = io.StringIO()
        stream.close()
    setattr(sys, name, stream)
    evt.set()


@pytest.mark.parametrize("name", ["stdout", "stderr"])
@pytest.mark.parametrize("action", ["close", "remove"])
def test_a_target_that_breaks_its_std_streams_still_exits_0(name: str, action: str) -> None:
    evt = fiber_core.Event()
    p = fiber_core.Process(target=_break_stream, args=(evt, name, action))
    p.start()
    p.join(T)
    assert evt.is_set() and p.exitcode == 0


def _print_lines() -> None:
    for i in range(60):
        print(f"line {i}", flush=True)
    print("\x1b[31mred\x1b[0m and \x07bell\x1b]0;title\x07", flush=True)
    print("x" * 1000, flush=True)
    sys.stdout.write("no newline at the end")
    sys.stdout.flush()


def _print_to_stderr() -> None:
    print("to stderr", file=sys.stderr, flush=True)


def test_output_tail_keeps_the_last_lines_printed_without_control_characters_and_cut_short(
        capfd: pytest.CaptureFixture[str]) -> None:
    p = fiber_core.Process(target=_print_lines)
    assert p.output_tail() == []
    p.start()
    p.join(T)
    assert p.exitcode == 0
    tail = p.output_tail()
    assert len(tail) == 50
    assert tail[-3:] == ["red and bell", "x" * 300, "no newline at the end"]
    assert tail[0] == "line 13" and tail[-4] == "line 59"
    assert p.output_tail(2) == tail[-2:] and p.output_tail(0) == []
    out, _ = capfd.readouterr()
    assert f"[{p.name}] line 59" in out  # still printed, prefixed, as before
    # stderr's lines are kept too. (Its pipe is not stdout's: lines of the two streams are
    # kept in the order they arrive, which need not be the order they were printed in.)
    e = fiber_core.Process(target=_print_to_stderr)
    e.start()
    e.join(T)
    assert e.output_tail() == ["to stderr"]
