"""Option types: one configuration key (name, type, default, help) and the parsers of its values."""

from __future__ import annotations

from fiber_core.base.errors import ConfigError

TYPE_CHECKING = False  # typing's own, without importing typing: a job starts without it
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any

_TRUE = {"1", "true", "yes", "on"}


_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


def _parse_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_pairs(items: Iterable[str], what: str) -> dict[str, str]:
    """``KEY=VALUE`` entries (from a ``list`` option or the command line) as a dict.

    A bad entry is a :class:`ConfigError` that names ``what`` it belongs to.
    """
    out = {}
    for item in items:
        key, found, value = item.partition("=")
        if not found or not key.strip():
            raise ConfigError(f"bad {what} entry {item!r}: expected KEY=VALUE")
        out[key.strip()] = value
    return out


_PARSERS: dict[type, Callable[[str], Any]] = {
    bool: _parse_bool,
    int: int,
    float: float,
    str: str,
    list: _parse_list,
}


class Option:
    """One configuration key: its name, type, default and a line of help.

    ``type`` is one of ``bool``, ``int``, ``float``, ``str``, ``list`` (a
    comma-separated string in files and variables). ``choices`` restricts the
    allowed values. ``secret`` options are never printed by ``fiber config``.
    Options compare equal when all six fields do.

    (A plain class, not a ``typing.NamedTuple``: that compiles each field's annotation
    when the class is made, about a millisecond of every job's start.)
    """

    __slots__ = ("name", "type", "default", "help", "choices", "secret")

    def __init__(self, name: str, type: type = str, default: Any = None, help: str = "",
                 choices: tuple[Any, ...] = (), secret: bool = False) -> None:
        self.name = name
        self.type = type
        self.default = default
        self.help = help
        self.choices = choices
        self.secret = secret

    def _key(self) -> tuple[Any, ...]:
        return self.name, self.type, self.default, self.help, self.choices, self.secret

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Option) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (f"Option({self.name!r}, {self.type.__name__}, {self.default!r}, {self.help!r}, "
                f"choices={self.choices!r}, secret={self.secret!r})")

    def parse(self, value: Any, key: str, source: str) -> Any:
        """Convert ``value`` (a string or an already-typed value) or raise ConfigError."""
        if value is None:
            return None
        try:
            if isinstance(value, str) and self.type is not str:
                result = _PARSERS[self.type](value)
            elif self.type is float and isinstance(value, int) and not isinstance(value, bool):
                result = float(value)
            elif self.type is list and isinstance(value, (list, tuple)):
                result = [str(v) for v in value]
            elif isinstance(value, self.type) and not (
                self.type is int and isinstance(value, bool)
            ):
                result = value
            else:
                raise ValueError(f"expected {self.type.__name__}, got {type(value).__name__}")
        except ValueError as e:
            raise ConfigError(
                f"bad value {value!r} for {key} (from {source}): {e}"
            ) from None
        if self.choices and result not in self.choices:
            allowed = ", ".join(map(str, self.choices))
            raise ConfigError(f"bad value {value!r} for {key} (from {source}): expected one of {allowed}")
        return result
