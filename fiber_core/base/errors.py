"""Every exception Fiber raises, in one place.

Each subclasses the standard type that callers of :mod:`multiprocessing` already
catch, so ``except multiprocessing.ProcessError`` or ``except LookupError`` keeps
working when a program switches to Fiber.
"""

from __future__ import annotations

import multiprocessing

from fiber_core.base.log import log

TYPE_CHECKING = False  # typing's own, without importing typing: a job starts without it
if TYPE_CHECKING:
    from typing import Any

ProcessError = multiprocessing.ProcessError


BufferTooShort = multiprocessing.BufferTooShort


TimeoutError = multiprocessing.TimeoutError  # noqa: A001 - same name as the stdlib's


AuthenticationError = multiprocessing.AuthenticationError


SUMMARY_CHARS = 300
"""At most this much of a cause's first line goes into the message of the error that wraps it."""


def summary(error: BaseException) -> str:
    """One line that names ``error``: its qualified type and the first line of its message."""
    cls = type(error)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    lines = str(error).strip().splitlines()
    first = lines[0].strip() if lines else ""
    if len(first) > SUMMARY_CHARS:
        first = first[:SUMMARY_CHARS - 3] + "..."
    return f"{name}: {first}" if first else name


class FiberError(ProcessError):
    """Base class of the errors that only Fiber raises.

    An error that wraps another library's exception (an SDK's, a socket's) is raised with
    ``cause=``: ``raise BackendError("what failed. What to do", cause=e)``. Its message says
    what to do first and ends with the cause's one-line :func:`summary`; a traceback shows it
    alone, not the SDK's chain of exceptions above it, as ``raise ... from None`` would
    (PEP 409). The original is kept for debugging on :attr:`cause` and ``__context__``
    (PEP 415): ``traceback.print_exception(err.cause)`` prints its traceback, and so does
    the ``fiber`` logger at DEBUG level (``fiber_core.log_to_stderr(logging.DEBUG)``) when
    the error is made. The cause does not travel when the error is pickled to another process.
    """

    cause: BaseException | None = None
    """The exception this error wraps (``cause=``), or None."""

    def __init__(self, *args: object, cause: BaseException | None = None) -> None:
        if cause is not None:
            if args and isinstance(args[0], str):
                args = (f"{args[0]} (cause: {summary(cause)})", *args[1:])
            self.cause = cause
            self.__context__ = cause
            self.__suppress_context__ = True
            if log.isEnabledFor(10):  # logging.DEBUG
                log.debug("fiber: %s", args[0] if args else type(self).__name__, exc_info=cause)
        super().__init__(*args)

    def __reduce__(self) -> tuple[Any, ...]:
        # Like BaseException's, without the cause: an SDK's exception may not pickle, and the
        # message already carries its summary.
        state = {k: v for k, v in self.__dict__.items() if k != "cause"}
        return (type(self), self.args, state) if state else (type(self), self.args)


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

    def __init__(self, message: str, exitcode: int | None = None, logs: str = "",
                 cause: BaseException | None = None) -> None:
        super().__init__(message, cause=cause)
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


class QueueCutError(FiberError, ConnectionError):
    """A queue handle's connection to the queue's owner ended while its program held items it
    had taken and the owner had not yet heard of: if the owner lives, they are back in the
    queue and may be delivered again. Raised once, by the handle's next call (which the one
    after reconnects), so that a connection cut never duplicates items silently."""

    def __init__(self, taken: int) -> None:
        super().__init__(
            f"the connection to this queue's owner ended while this process held {taken} items it "
            f"had taken and the owner had not yet heard of (the owner's process exited, or the "
            f"connection was cut): if the owner lives, those items are back in the queue and "
            f"other getters may get them again. The next call reconnects")
        self.taken = taken


class PipeCutError(FiberError, BrokenPipeError, EOFError):
    """The connection between a Pipe's creator and a copy of an end held in another process
    ended without that copy being closed (its process ended, or the connection was cut), and
    messages sent on it may not have arrived. Raised on both sides instead of losing them
    silently: by the creator's end that sent them (``unacknowledged``: how many the reader had
    not acknowledged, an upper bound of those lost), and by the reading copy
    (``received``: how many came to it on that connection). It is a ``BrokenPipeError`` for a
    writer and an ``EOFError`` for a reader, what each gets when the other side is gone."""

    def __init__(self, unacknowledged: int | None = None, received: int | None = None) -> None:
        if unacknowledged is not None:
            text = (f"the connection to a process reading this Pipe ended without it closing its "
                    f"end (its process ended, or the connection was cut): {unacknowledged} "
                    f"message(s) this end sent to it may not have arrived (not acknowledged); "
                    f"the message of this call was not sent")
        else:
            text = (f"the connection to this Pipe's creator ended before the end of the pipe "
                    f"(the creator's process ended, or the connection was cut) after "
                    f"{received} message(s) came to this end on it: what was sent after them may "
                    f"not have arrived (if the creator lives, the end that sent them raises "
                    f"PipeCutError with their number)")
        super().__init__(text)
        self.unacknowledged = unacknowledged
        self.received = received

    def __reduce__(self) -> tuple:
        return type(self), (self.unacknowledged, self.received)


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


class ForeignObjectError(FiberError, PermissionError):
    """Something Fiber would trust by its name belongs to another user, or is open to others.

    A named semaphore or shared-memory segment of the run that another local user made under
    its name (after its creator removed it), or a file or directory in a shared place
    (``/dev/shm``) that is not this user's private one. It is not used; the message says
    which one, whose it is, and what to do.
    """


class RemoteError(FiberError):
    """Carries the formatted traceback of an exception raised in another process."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return "\n\nRemote traceback:\n" + self.tb


class JournalError(FiberError):
    """The journal of a durable run cannot be used (see docs/durable.md); the message says why and what to do."""


class JournalBusyError(JournalError):
    """Another master of the program holds the journal's lease: it runs, or ended less than a lease ago."""
