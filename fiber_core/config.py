"""Typed configuration: ``fiber_core.init()``, ``FIBER_*`` variables, ``.fiberconfig``.

Precedence, highest first: a value passed explicitly to the call that needs it,
``fiber_core.init(key=value)``, the environment variable ``FIBER_KEY``, the
``.fiberconfig`` INI file in the working directory, the option's default.

Global options live in the ``[fiber]`` section of ``.fiberconfig``. A backend's
options are namespaced by its name: ``[docker] image = ...`` in the file,
``FIBER_DOCKER_IMAGE`` in the environment, ``init(docker_image=...)`` in code.
Every value is parsed to its declared type when it is read, and a bad one raises
:class:`~fiber_core.errors.ConfigError` naming the key and where it came from.
"""

from __future__ import annotations

import configparser
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from fiber_core.errors import ConfigError

CONFIG_FILE = ".fiberconfig"
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


class Option(NamedTuple):
    """One configuration key: its name, type, default and a line of help.

    ``type`` is one of ``bool``, ``int``, ``float``, ``str``, ``list`` (a
    comma-separated string in files and variables). ``choices`` restricts the
    allowed values. ``secret`` options are never printed by ``fiber config``.
    """

    name: str
    type: type = str
    default: Any = None
    help: str = ""
    choices: tuple[Any, ...] = ()
    secret: bool = False

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


GLOBAL_OPTIONS: tuple[Option, ...] = (
    Option("backend", str, "local", "backend that runs jobs (fiber backends lists them)"),
    Option("debug", bool, False, "verbose logging from fiber itself"),
    Option("forward_output", bool, True, "print each job's stdout/stderr in the parent, prefixed with its name"),
    Option("python", str, None, "python executable that jobs run (default: the backend's choice)"),
    Option("listen_host", str, None, "address jobs use to reach this process (default: the backend's choice)"),
    Option("listen_port", int, 0, "TCP port this process listens on for its jobs (0: any free port)"),
    Option("image", str, None, "container image for container backends"),
    Option("cpu", float, None, "CPUs requested per job"),
    Option("memory", int, None, "memory requested per job, in MiB"),
    Option("gpu", int, None, "GPUs requested per job"),
    Option("gpu_type", str, None, "GPU type requested per job"),
    Option("peer_timeout", float, 30.0, "seconds after which a TCP peer that stopped answering (its host lost or cut off) counts as gone (0: the kernel's defaults, which take minutes to hours)"),
    Option("start_timeout", float, 0.0, "seconds a job may take to reach its parent before it is failed (0: wait for the backend)"),
)


class Value(NamedTuple):
    """A resolved value and where it came from (for ``fiber config``)."""

    value: Any
    source: str


class Config:
    """The configuration of this process: call :meth:`get` to read a typed value."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._init: dict[str, Any] = {}
        self._file: configparser.ConfigParser | None = None
        self._file_path: str | None = None
        self._backend_options: dict[str, tuple[Option, ...]] = {}

    # -- sources -----------------------------------------------------------------

    def init(self, **kwargs: Any) -> None:
        """Set values in code (``fiber_core.init``); they beat variables and files."""
        known = self._known_keys()
        if not known.keys() >= kwargs.keys():
            from fiber_core.registry import registry

            registry.backends()  # load the installed plugins: their options become known
            known = self._known_keys()
        for key, value in kwargs.items():
            option = known.get(key)
            if option is None and not self._is_unloaded_backend_key(key):
                raise ConfigError(
                    f"unknown configuration key {key!r} passed to init(); known keys: "
                    + ", ".join(sorted(known))
                )
            if option is not None:
                value = option.parse(value, key, "init()")
            with self._lock:
                self._init[key] = value

    def reset(self) -> None:
        """Forget values set by :meth:`init` and re-read ``.fiberconfig`` on next use."""
        with self._lock:
            self._init.clear()
            self._file = None
            self._file_path = None

    def register_backend_options(self, backend: str, options: Iterable[Option]) -> None:
        self._backend_options[backend] = tuple(options)

    def _is_unloaded_backend_key(self, key: str) -> bool:
        # init(docker_image=...) while fiber-docker is not installed: kept, checked once it is.
        from fiber_core.registry import KNOWN_PACKAGES

        prefix = key.split("_", 1)[0]
        return "_" in key and prefix in KNOWN_PACKAGES and prefix not in self._backend_options

    def _known_keys(self) -> dict[str, Option]:
        known = {o.name: o for o in GLOBAL_OPTIONS}
        for backend, options in self._backend_options.items():
            for o in options:
                known[f"{backend}_{o.name}"] = o
        return known

    def _read_file(self) -> configparser.ConfigParser:
        with self._lock:
            if self._file is not None:
                return self._file
            parser = configparser.ConfigParser(interpolation=None)
            path = os.path.abspath(CONFIG_FILE)
            if os.path.exists(path):
                try:
                    parser.read(path, encoding="utf-8")
                except configparser.Error as e:
                    raise ConfigError(
                        f"malformed {path}: {e}. It is an INI file: a [fiber] section "
                        "for global keys, a [<backend>] section per backend."
                    ) from None
                self._file_path = path
            self._file = parser
            return parser

    # -- reading -------------------------------------------------------------------

    def lookup(self, key: str, section: str = "fiber") -> Value:
        """Resolve ``key`` in ``section`` (``fiber`` or a backend name)."""
        if section == "fiber":
            full, option = key, {o.name: o for o in GLOBAL_OPTIONS}.get(key)
        else:
            full = f"{section}_{key}"
            option = {o.name: o for o in self._backend_options.get(section, ())}.get(key)
        if option is None:
            raise ConfigError(f"unknown configuration key {full!r}")
        with self._lock:
            has_init, init_value = full in self._init, self._init.get(full)
        if has_init:
            return Value(option.parse(init_value, full, "init()"), "init()")
        env = "FIBER_" + full.upper()
        if env in os.environ:
            return Value(option.parse(os.environ[env], env, "environment"), f"env {env}")
        parser = self._read_file()
        if parser.has_option(section, key):
            where = f"{self._file_path} [{section}]"
            return Value(option.parse(parser.get(section, key), f"{key} in [{section}]", where), where)
        return Value(option.default, "default")

    def get(self, key: str, section: str = "fiber") -> Any:
        return self.lookup(key, section).value

    def backend_settings(self, backend: str) -> dict[str, Any]:
        """Every option of ``backend``, resolved and typed."""
        return {o.name: self.get(o.name, backend) for o in self._backend_options.get(backend, ())}

    def check_file(self) -> None:
        """Validate every key of ``.fiberconfig`` whose section is known."""
        parser = self._read_file()
        globals_ = {o.name for o in GLOBAL_OPTIONS}
        for section in parser.sections():
            names = globals_ if section == "fiber" else (
                {o.name for o in self._backend_options[section]}
                if section in self._backend_options else None
            )
            if names is None:
                continue
            for key in parser.options(section):
                if key not in names:
                    raise ConfigError(
                        f"unknown key {key!r} in [{section}] of {self._file_path}; known: "
                        + ", ".join(sorted(names))
                    )
                self.lookup(key, section)

    def snapshot(self) -> dict[str, Any]:
        """Values set in code, to hand to child processes so they see the same config."""
        with self._lock:
            return dict(self._init)

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Take the parent's :meth:`snapshot`, checked there (this job may lack its plugins)."""
        with self._lock:
            self._init.update(snapshot)

    def describe(self) -> list[tuple[str, str, str]]:
        """(key, value, source) rows for ``fiber config``; secrets are masked."""
        rows = []
        for o in GLOBAL_OPTIONS:
            v = self.lookup(o.name)
            rows.append((o.name, _show(v.value, o), v.source))
        for backend, options in sorted(self._backend_options.items()):
            for o in options:
                v = self.lookup(o.name, backend)
                rows.append((f"{backend}.{o.name}", _show(v.value, o), v.source))
        return rows


def _show(value: Any, option: Option) -> str:
    if option.secret and value:
        return "********"
    return "" if value is None else str(value)


config = Config()
"""The process-wide configuration."""
