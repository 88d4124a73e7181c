"""Fiber's errors that wrap another library's exception: the fix first, the cause summed up and kept."""

from __future__ import annotations

import logging
import pickle
import traceback

import pytest

from fiber_core.base.errors import BackendError, ConfigError, FiberError, JobStartError, summary


class SdkError(Exception):
    """Stands for an SDK's exception: a chain of its own, and a message over several lines."""


def _sdk_failure() -> SdkError:
    try:
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except OSError as e:
            raise SdkError("Max retries exceeded with url: /api\nHTTP response headers: ...") from e
    except SdkError as e:
        return e


def _wrapped() -> BackendError:
    cause = _sdk_failure()
    try:
        try:
            raise cause
        except SdkError as e:
            raise BackendError("cannot reach the cluster at X. Start it, or set FIBER_Y", cause=e) from None
    except BackendError as e:
        return e


def test_the_message_says_what_to_do_then_sums_up_the_cause() -> None:
    err = _wrapped()
    assert str(err) == ("cannot reach the cluster at X. Start it, or set FIBER_Y (cause: "
                        "test_errors.SdkError: Max retries exceeded with url: /api)")
    assert isinstance(err.cause, SdkError)
    assert err.__context__ is err.cause and err.__cause__ is None and err.__suppress_context__


def test_the_traceback_shows_the_error_alone() -> None:
    text = "".join(traceback.format_exception(type(err := _wrapped()), err, err.__traceback__))
    assert text.count("SdkError") == 1  # in the message's summary, and nowhere else
    assert "ConnectionRefusedError" not in text
    assert "The above exception" not in text and "During handling" not in text
    assert text.rstrip().splitlines()[-1].startswith("fiber_core.base.errors.BackendError: cannot reach")
    # ...and the cause's own traceback is there for whoever asks.
    cause = err.cause
    assert cause is not None
    full = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
    assert "ConnectionRefusedError: [Errno 111] Connection refused" in full


def test_the_cause_is_kept_even_when_raised_outside_its_handler() -> None:
    cause = _sdk_failure()
    err = ConfigError("bad setting x (from FIBER_X): use y", cause=cause)
    with pytest.raises(ConfigError) as info:
        raise err
    assert info.value.cause is cause and info.value.__context__ is cause
    assert info.value.__suppress_context__


def test_summary_is_one_line_named_and_bounded() -> None:
    assert summary(OSError(2, "No such file")) == "FileNotFoundError: [Errno 2] No such file"
    assert summary(SdkError()) == "test_errors.SdkError"
    long = summary(SdkError("x" * 1000 + "\nmore"))
    assert len(long) < 350 and long.endswith("...") and "\n" not in long


def test_a_wrapped_error_pickles_without_its_cause() -> None:
    class Unpicklable(Exception):
        def __reduce__(self):  # noqa: ANN204 - an SDK's exception holding a socket, say
            raise TypeError("cannot pickle")

    err = JobStartError("could not start x: check y", 3, "the log", cause=Unpicklable("z"))
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is JobStartError and str(copy) == str(err) == "could not start x: check y (cause: " \
        "test_errors.test_a_wrapped_error_pickles_without_its_cause.<locals>.Unpicklable: z)"
    assert (copy.exitcode, copy.logs, copy.cause) == (3, "the log", None)
    plain = pickle.loads(pickle.dumps(FiberError("no cause")))
    assert str(plain) == "no cause" and plain.cause is None


def test_the_fiber_logger_at_debug_prints_the_causes_traceback(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="fiber"):
        _wrapped()
    assert not caplog.records
    with caplog.at_level(logging.DEBUG, logger="fiber"):
        _wrapped()
    [record] = caplog.records
    assert record.getMessage().startswith("fiber: cannot reach the cluster at X")
    assert "ConnectionRefusedError" in caplog.text  # the whole chain of the cause
