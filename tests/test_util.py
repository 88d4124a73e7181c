"""``get_logger()`` and ``log_to_stderr()``, as in ``multiprocessing``."""

from __future__ import annotations

import logging

import fiber_core


def test_get_logger() -> None:
    logger = fiber_core.get_logger()
    assert logger is logging.getLogger("fiber") is fiber_core.get_logger()


def test_log_to_stderr_in_parent_and_child(run_script) -> None:  # noqa: ANN001
    out = run_script("""
        import logging, fiber_core

        def child():
            fiber_core.log_to_stderr(logging.INFO).info("child says")

        if __name__ == "__main__":
            logger = fiber_core.log_to_stderr(logging.INFO)
            assert fiber_core.log_to_stderr() is logger and len(logger.handlers) == 1
            assert logger.level == logging.INFO
            logger.info("parent says")
            logger.debug("not shown")
            p = fiber_core.Process(target=child, name="worker-7")
            p.start()
            p.join()
    """)
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [
        "[INFO/MainProcess] parent says",
        "[worker-7] [INFO/worker-7] child says",
    ]


def test_fiber_logs_a_failed_start(run_script, tmp_path) -> None:  # noqa: ANN001
    broken = tmp_path / "broken-python"
    broken.write_text("#!/bin/sh\necho no such thing >&2\nexit 3\n")
    broken.chmod(0o755)
    out = run_script("""
        import logging, fiber_core

        if __name__ == "__main__":
            fiber_core.log_to_stderr(logging.WARNING)
            p = fiber_core.Process(target=print, name="doomed")
            p.start()
            p.join()
            print("exitcode", p.exitcode)
    """, env={"FIBER_PYTHON": str(broken)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["exitcode 3"]
    assert "[WARNING/MainProcess] fiber: doomed exited with code 3 before it started" in out.stderr
    assert "no such thing" in out.stderr
