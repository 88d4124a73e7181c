"""File descriptors: the soft limit raised at start, about three per pool worker, an error
that names the limit when it is reached, and descriptors past 1,024 that work.

Each case runs in a fresh interpreter whose limits the test sets before it starts.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

T = 120.0


def run(code: str, tmp_path: Path, soft: int, hard: int,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(code))

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=T,
                          preexec_fn=limit, cwd=tmp_path, env={**os.environ, **(env or {})})


def test_the_soft_limit_is_raised_to_the_hard_one_at_start(tmp_path: Path) -> None:
    out = run("""
        import resource
        import fiber_core
        from fiber_core.runtime.run import runtime
        before = resource.getrlimit(resource.RLIMIT_NOFILE)
        runtime()
        print(before[0], resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    """, tmp_path, soft=256, hard=4096)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["256", "4096"]


POOL = """
    import os, sys
    import fiber_core as mp

    def init(barrier):
        global _barrier
        _barrier = barrier

    def meet(x):
        _barrier.wait(60)  # every worker holds a task at once: all are connected
        return x

    if __name__ == "__main__":
        n = int(sys.argv[1]) if len(sys.argv) > 1 else 48
        barrier = mp.Barrier(n)
        before = len(os.listdir("/proc/self/fd"))
        with mp.Pool(n, initializer=init, initargs=(barrier,)) as pool:
            assert pool.map(meet, range(n), chunksize=1) == list(range(n))
            print((len(os.listdir("/proc/self/fd")) - before) / n)
"""


def test_a_pool_worker_costs_the_parent_about_three_descriptors(tmp_path: Path) -> None:
    out = run(POOL, tmp_path, soft=1024, hard=1024)
    assert out.returncode == 0, out.stderr
    # its two connections (process, pool) and its sentinel; a pipe sentinel made it four
    assert float(out.stdout) < 3.3


def test_running_out_names_the_limit_and_fails_the_pool_at_once(tmp_path: Path) -> None:
    out = run(POOL, tmp_path, soft=60, hard=60)
    assert out.returncode != 0
    # the program's own error (the listener may log after it, as it gets descriptors back)
    errors = [line for line in out.stderr.splitlines()
              if line.startswith(("fiber_core.base.errors.BackendError: ", "OSError: "))]
    assert errors, out.stderr
    assert "out of file descriptors" in errors[-1] and "its limit is 60" in errors[-1] and "ulimit -n" in errors[-1]
    assert "waiting for the backend" not in out.stderr  # not taken for a backend's refusal


def test_descriptors_past_1024_work(tmp_path: Path) -> None:
    out = run("""
        import os, queue
        import fiber_core as mp

        def wait_in_vain(q, lock):
            # Both wait on this process's parent, which checks the connection now and then
            # while they wait: on descriptors above 1,024 there.
            try:
                q.get(timeout=1.0)
            except queue.Empty:
                print("queue empty", flush=True)
            print("lock taken", lock.acquire(timeout=0.5), flush=True)

        if __name__ == "__main__":
            held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
            q, lock = mp.Queue(), mp.Lock()
            with lock:
                p = mp.Process(target=wait_in_vain, args=(q, lock))
                p.start()
                p.join(60)
            with mp.Pool(2) as pool:
                assert pool.map(abs, range(-50, 0)) == list(range(50, 0, -1))
            print("exit", p.exitcode, min(held) < 1024 < max(held))
    """, tmp_path, soft=4096, hard=4096, env={"FIBER_SYNC_SERVED": "1"})
    assert out.returncode == 0, out.stderr
    assert "] queue empty\n" in out.stdout and "] lock taken False\n" in out.stdout  # the child's
    assert out.stdout.endswith("exit 0 True\n")
