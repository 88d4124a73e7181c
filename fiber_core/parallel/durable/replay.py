"""What a journal recorded, and which of it a new run of the program may take: pure.

:class:`Recorded` folds a journal's records into the calls and finished units they
describe (a ``TRUNCATE`` record voids what was recorded for its call and those after).
:class:`Replay` answers, call by call, in the order the program makes them: the
recorded results of a call whose identity matches the recorded one, and the end of the
replay at the first call that differs (with the one warning that names it). After the
end, nothing recorded is handed out again: results never reach a call they do not
belong to.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from fiber_core.parallel.durable import records
from fiber_core.parallel.durable.records import CallIdentity


class Recorded:
    """The calls and finished units of a journal's records, as of its last record."""

    def __init__(self) -> None:
        self.calls: dict[int, CallIdentity] = {}
        self.units: dict[int, dict[int, tuple[bytes, Any]]] = {}  # ordinal -> index -> (digest, values)

    def add(self, kind: bytes, payload: bytes) -> None:
        """Fold one record in (the header is the caller's)."""
        if kind == records.CALL:
            identity = records.read_call(payload)
            self.calls[identity.ordinal] = identity
        elif kind == records.UNITS:
            ordinal, digests, values = records.read_units(payload)
            if ordinal in self.calls:
                done = self.units.setdefault(ordinal, {})
                for (index, digest), value in zip(digests, values):
                    done[index] = (digest, value)
        elif kind == records.TRUNCATE:
            self.drop_from(records.read_truncate(payload))

    def drop_from(self, ordinal: int) -> None:
        for recorded in (self.calls, self.units):
            for k in [k for k in recorded if k >= ordinal]:
                del recorded[k]

    def counts(self) -> tuple[int, int]:
        """Calls recorded, and units recorded finished."""
        return len(self.calls), sum(map(len, self.units.values()))


class Verdict(NamedTuple):
    """What a new call gets: ``units`` (index -> (digest, values)) recorded for it; ``truncate``:
    the journal must void what it holds from this call on; ``warning``: the one line to log."""

    units: dict[int, tuple[bytes, Any]]
    truncate: bool
    warning: str | None


_NOTHING = Verdict({}, False, None)


def difference(recorded: CallIdentity, now: CallIdentity) -> str:
    """How a call differs from the recorded call of the same place, for people."""
    if recorded.name != now.name:
        return f"the journal recorded {recorded.name} there"
    if recorded.func != now.func:
        return "its function's code differs from the recorded one"
    return "its arguments differ from the recorded ones"


class Replay:
    """Hands out recorded results call by call, until the program goes another way."""

    def __init__(self, recorded: Recorded) -> None:
        self._recorded = recorded
        self.active = bool(recorded.calls)
        self.ended_at: int | None = None  # the call at which the replay ended

    def begin(self, identity: CallIdentity) -> Verdict:
        """The program makes ``identity``'s call: what of it is recorded."""
        if not self.active:
            return _NOTHING
        before = self._recorded.calls.get(identity.ordinal)
        if before is None:  # past what was recorded: the run goes on from here
            self._end(identity.ordinal)
            return Verdict({}, any(k >= identity.ordinal for k in self._recorded.units), None)
        if before != identity:
            self._end(identity.ordinal)
            return Verdict({}, True, (
                f"fiber: the journal's replay ends at call {identity.ordinal}, {identity.name}: "
                f"{difference(before, identity)}; it and the calls after it run again"))
        return Verdict(self._recorded.units.get(identity.ordinal, {}), False, None)

    def unit(self, identity: CallIdentity, index: int, digest: bytes) -> tuple[bool, Any, str | None]:
        """A unit of a call whose arguments are checked unit by unit (``imap``): ``(True,
        values, None)`` if recorded for these arguments; ``(False, None, warning)`` where
        they differ (the replay ends: the caller voids the call and records it again)."""
        if self.ended_at is not None and self.ended_at <= identity.ordinal:
            return False, None, None
        done = self._recorded.units.get(identity.ordinal, {})
        got = done.get(index)
        if got is None:
            return False, None, None
        if got[0] != digest:
            self._end(identity.ordinal)
            return False, None, (
                f"fiber: the journal's replay ends at call {identity.ordinal}, {identity.name}, "
                f"unit {index}: its arguments differ from the recorded ones; it and the calls "
                "after it run again")
        return True, got[1], None

    def _end(self, ordinal: int) -> None:
        self.active = False
        self.ended_at = ordinal
        self._recorded.drop_from(ordinal)
