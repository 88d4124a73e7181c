"""Logging helpers with the names of :mod:`multiprocessing.util`."""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # typing's own, without importing typing: a job starts without it
if TYPE_CHECKING:
    import logging
    from typing import Any


LOGGER_NAME = "fiber"


DEFAULT_FORMAT = "[%(levelname)s/%(processName)s] %(message)s"


def get_logger() -> logging.Logger:
    """Fiber's logger (``"fiber"``); like ``multiprocessing.get_logger()`` it has no handler until you add one."""
    import logging  # on first use: a job starts without it (see _Log)

    return logging.getLogger(LOGGER_NAME)


class _Log:
    """Fiber's logger, imported on first use: a job starts without :mod:`logging`."""

    def __getattr__(self, name: str) -> Any:
        return getattr(get_logger(), name)


log = _Log()


def tail(text: str, lines: int = 20) -> str:
    """The last ``lines`` lines of ``text`` (a job's log), without surrounding blank space."""
    return "\n".join(text.strip().splitlines()[-lines:])


def log_to_stderr(level: int | None = None) -> logging.Logger:
    """Send Fiber's log to stderr with the process name, like the stdlib's function."""
    import logging  # see get_logger

    logger = get_logger()
    if not any(getattr(h, "_fiber_stderr", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(DEFAULT_FORMAT))
        handler._fiber_stderr = True  # type: ignore[attr-defined]  # noqa: SLF001 - a mark on logging's handler object, to find Fiber's own handler again
        logger.addHandler(handler)
    if level:
        logger.setLevel(level)
    return logger
