"""What a process inherits as under the stdlib's spawn: Ctrl-C, ``sys.argv``, logging, and the rest."""

from __future__ import annotations

import gc
import logging
import os
import pty
import select
import signal
import subprocess
import sys
import textwrap
import threading
import weakref
from multiprocessing import shared_memory
from pathlib import Path

import pytest

import fiber_core
from fiber_core.connection import Client, Listener, families

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed


# -- Ctrl-C at a terminal -----------------------------------------------------------------


SLEEPER = """
    import signal, sys, time, fiber_core

    def sleeper(q):
        q.put("up")
        time.sleep(60)

    def mine(signum, frame):
        print("my handler", flush=True)
        sys.exit(3)

    if __name__ == "__main__":
        if "--own-handler" in sys.argv:
            signal.signal(signal.SIGINT, mine)
        q = fiber_core.Queue()
        p = fiber_core.Process(target=sleeper, args=(q,), name="sleeper")
        p.start()
        q.get()
        print("ready", flush=True)
        p.join()
        print("joined", p.exitcode, flush=True)
"""


def _read_until(fd: int, out: bytearray, marker: bytes | None) -> None:
    """Read the terminal into ``out`` until ``marker`` shows (None: until it closes), within T."""
    while marker is None or marker not in out:
        ready, _, _ = select.select([fd], [], [], T)
        assert ready, f"nothing within {T}s; so far: {out.decode(errors='replace')}"
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the program ended and closed the terminal
            chunk = b""
        if not chunk:
            assert marker is None, f"ended before {marker!r}: {out.decode(errors='replace')}"
            return
        out += chunk


def _ctrl_c(tmp_path: Path, *args: str) -> tuple[str, int]:
    """Run SLEEPER in a terminal, press Ctrl-C once it is ready; (what it showed, wait status)."""
    script = tmp_path / "sleeper.py"
    script.write_text(textwrap.dedent(SLEEPER))
    pid, fd = pty.fork()
    if pid == 0:  # the program, on the terminal (its own session, the foreground group)
        # As an interactive shell starts it: SIGINT at its default, even when this suite
        # runs with it ignored (nohup, or in the background of a non-interactive shell).
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.chdir(tmp_path)
        os.execv(sys.executable, [sys.executable, str(script), *args])
    out = bytearray()
    try:
        _read_until(fd, out, b"ready")
        os.write(fd, b"\x03")  # the terminal sends SIGINT to the foreground process group
        _read_until(fd, out, None)
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        raise
    finally:
        os.close(fd)
        _, status = os.waitpid(pid, 0)  # it closed the terminal: it is ending
    return out.decode(errors="replace").replace("\r\n", "\n"), status


def test_ctrl_c_stops_a_program_whose_process_runs(tmp_path: Path) -> None:
    shown, status = _ctrl_c(tmp_path)
    assert "joined" not in shown
    # The job got it as a stdlib child does: KeyboardInterrupt in its target.
    assert "[sleeper] Process sleeper:" in shown
    assert "[sleeper] KeyboardInterrupt" in shown
    # And the program, as with the stdlib: its own traceback, then the end.
    assert shown.rstrip().endswith("KeyboardInterrupt")
    assert shown.index("Traceback") < shown.index("[sleeper] Process sleeper:")
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGINT


def test_ctrl_c_with_the_programs_own_handler(tmp_path: Path) -> None:
    shown, status = _ctrl_c(tmp_path, "--own-handler")
    assert "my handler" in shown
    assert "[sleeper] KeyboardInterrupt" in shown  # the job got it too
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3


# -- sys.argv ---------------------------------------------------------------------------------


ARGV = """
    import argparse, sys, fiber_core

    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, required=True)
    args = parser.parse_args()  # at import: every job imports the main module

    def report(q):
        q.put((args.seed, sys.argv[1:]))

    if __name__ == "__main__":
        q = fiber_core.Queue()
        p = fiber_core.Process(target=report, args=(q,))
        p.start()
        print(q.get(timeout=30))
        p.join()
        print(p.exitcode)
"""


def test_sys_argv_reaches_jobs_before_the_main_module_runs(tmp_path: Path) -> None:
    script = tmp_path / "argv.py"
    script.write_text(textwrap.dedent(ARGV))
    out = subprocess.run([sys.executable, str(script), "--seed", "7"], capture_output=True,
                         text=True, cwd=tmp_path, timeout=2 * T)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["(7, ['--seed', '7'])", "0"]


# -- the smaller things -------------------------------------------------------------------------


def _put_exitcode(q: fiber_core.Queue) -> None:
    q.put(fiber_core.current_process().exitcode)


def test_current_process_has_no_exitcode_while_it_runs() -> None:
    assert fiber_core.current_process().exitcode is None
    q = fiber_core.Queue()
    p = fiber_core.Process(target=_put_exitcode, args=(q,))
    p.start()
    assert q.get(timeout=T) is None
    p.join(T)
    assert p.exitcode == 0


class _Callable:
    def __call__(self, q: fiber_core.Queue) -> None:
        q.put(5)


def test_a_started_process_drops_its_target_and_args() -> None:
    target = _Callable()
    ref = weakref.ref(target)
    q = fiber_core.Queue()
    p = fiber_core.Process(target=target, args=(q,))
    del target
    p.start()
    p.join(T)
    gc.collect()
    assert ref() is None
    assert q.get(timeout=T) == 5


def _put_level(q: fiber_core.Queue) -> None:
    q.put(fiber_core.get_logger().getEffectiveLevel())


@pytest.mark.parametrize("where", ["fiber", "root"])
def test_jobs_get_the_logger_level(where: str) -> None:
    logger = logging.getLogger() if where == "root" else fiber_core.get_logger()
    saved = logger.level, fiber_core.get_logger().level
    try:
        fiber_core.get_logger().setLevel(logging.NOTSET)
        logger.setLevel(37)
        q = fiber_core.Queue()
        p = fiber_core.Process(target=_put_level, args=(q,))
        p.start()
        assert q.get(timeout=T) == 37
        p.join(T)
    finally:
        logger.setLevel(saved[0])
        fiber_core.get_logger().setLevel(saved[1])


def _read_block(name: str, q: fiber_core.Queue) -> None:
    block = shared_memory.SharedMemory(name=name)
    q.put(bytes(block.buf[:5]))
    block.close()


def test_a_job_that_attaches_to_shared_memory_leaves_it_in_place() -> None:
    block = shared_memory.SharedMemory(create=True, size=16)
    try:
        block.buf[:5] = b"hello"
        q = fiber_core.Queue()
        for _ in range(2):  # the second finds the block the first attached to
            p = fiber_core.Process(target=_read_block, args=(block.name, q))
            p.start()
            p.join(T)
            assert p.exitcode == 0
            assert q.get(timeout=T) == b"hello"
    finally:
        block.close()
        block.unlink()


def _call(address: object, q: fiber_core.Queue) -> None:
    with Client(address, authkey=fiber_core.current_process().authkey) as conn:
        conn.send("hello")
        q.put(conn.recv())


def test_listener_and_client_between_processes_of_the_run() -> None:
    assert "AF_UNIX" in families and "AF_INET" in families
    q = fiber_core.Queue()
    key = fiber_core.current_process().authkey  # the run's key: every process of the run has it
    with Listener(authkey=key) as listener:
        p = fiber_core.Process(target=_call, args=(listener.address, q))
        p.start()
        with listener.accept() as conn:
            assert conn.recv() == "hello"
            conn.send("welcome")
    assert q.get(timeout=T) == "welcome"
    p.join(T)
    assert p.exitcode == 0
    with Listener(("127.0.0.1", 0), authkey=key) as listener:
        refused: list[BaseException] = []

        def accept() -> None:
            try:
                listener.accept()
            except fiber_core.AuthenticationError as e:
                refused.append(e)

        t = threading.Thread(target=accept)
        t.start()
        with pytest.raises(fiber_core.AuthenticationError):
            Client(listener.address, authkey=b"not the run's key")
        t.join(T)
        assert refused
