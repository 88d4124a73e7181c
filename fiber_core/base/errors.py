"""Every exception Fiber raises, in one place.

Each subclasses the standard type that callers of :mod:`multiprocessing` already
catch, so ``except multiprocessing.ProcessError`` or ``except LookupError`` keeps
working when a program switches to Fiber.
"""

from __future__ import annotations

import multiprocessing

ProcessError = multiprocessing.ProcessError


BufferTooShort = multiprocessing.BufferTooShort


TimeoutError = multiprocessing.TimeoutError  # noqa: A001 - same name as the stdlib's


AuthenticationError = multiprocessing.AuthenticationError


class FiberError(ProcessError):
    """Base class of the errors that only Fiber raises."""


class ConfigError(FiberError, ValueError):
    """A configuration value is missing, malformed or of the wrong type.

    The message names the key and where the value came from.
    """


class UnknownBackendError(FiberError, LookupError):
    """The selected backend is not installed; the message says what to pip-install."""


class PluginError(FiberError):
    """An installed plugin is broken (a misspelled hook, a bad registration)."""


class BackendError(FiberError):
    """A backend could not do what it was asked (start, poll, stop a job)."""


class JobStartError(BackendError):
    """A job could not be started, or died before it reached its parent.

    ``exitcode`` and ``logs`` carry what is known of the failed job.
    """

    def __init__(self, message: str, exitcode: int | None = None, logs: str = "") -> None:
        super().__init__(message)
        self.exitcode = exitcode
        self.logs = logs


class TaskLostError(FiberError):
    """Every worker that ran a pool task died while running it, so it is not retried again.

    The task probably kills its worker (it exits, crashes, or runs out of memory).
    """


class TaskExitError(FiberError):
    """A pool task ended its worker's work instead of returning or raising an ``Exception``.

    It called :func:`sys.exit` (:class:`SystemExit`), raised :class:`KeyboardInterrupt`,
    or its arguments could not be unpickled in the worker. The message names the
    task; the remote traceback is the ``__cause__``. Reported at the first occurrence:
    the task is not run again (unless the call asked for retries).
    """


class DeadlineError(FiberError, TimeoutError):
    """A pool call's deadline passed: its unfinished tasks were cancelled.

    For ``map``/``starmap``/``apply``: ``results`` holds what finished, in input
    order, with ``None`` for what did not; ``done`` and ``total`` count tasks. An
    ``imap`` iterator yields what finished before it raises this error (and its
    ``results`` is empty).
    """

    def __init__(self, message: str, results: list | None = None, done: int = 0,
                 total: int | None = None) -> None:
        super().__init__(message)
        self.results = results if results is not None else []
        self.done = done
        self.total = total


class PicklingError(FiberError, TypeError):
    """An object sent to another process cannot be pickled.

    Raised in the caller, before anything is sent, naming what failed.
    """


class RemoteError(FiberError):
    """Carries the formatted traceback of an exception raised in another process."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return "\n\nRemote traceback:\n" + self.tb
