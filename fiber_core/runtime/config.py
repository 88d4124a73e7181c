"""Configuration and backend selection: ``init()``, ``FIBER_*`` variables, ``.fiberconfig``.

Precedence, highest first: a value passed explicitly to the call that needs it,
``fiber_core.init(key=value)``, the environment variable ``FIBER_KEY``, the
``.fiberconfig`` INI file in the working directory, the option's default.

Global options live in the ``[fiber]`` section of ``.fiberconfig``. A backend's
options are namespaced by its name: ``[docker] image = ...`` in the file,
``FIBER_DOCKER_IMAGE`` in the environment, ``init(docker_image=...)`` in code.
Every value is parsed to its declared type when it is read, and a bad one raises
:class:`~fiber_core.base.errors.ConfigError` naming the key and where it came from.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Collection, Iterable

from fiber_core.base.errors import ConfigError, UnknownBackendError
from fiber_core.base.options import Option

TYPE_CHECKING = False  # typing's own, without importing typing: a job starts without it
if TYPE_CHECKING:
    import configparser
    from typing import Any

    from fiber_core.contract.backend import Backend
    from fiber_core.runtime.registry import Registry

CONFIG_FILE = ".fiberconfig"


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
    Option("gpu_type", str, None, "GPU type requested per job, or several in order of preference: a100,l40s (with counts: a100:1,l4:2)"),
    Option("capacity", str, None, "capacity kind requested per job (default: the platform's own)",
           choices=("spot", "on-demand", "spot-then-on-demand")),
    Option("on_demand_after", int, None, "with capacity spot-then-on-demand: a Pool task whose workers were "
           "preempted this many times runs its next attempt on on-demand capacity (default 2)"),
    Option("prices", list, [], "prices per hour for max_hourly_cost: TYPE[@spot|@on-demand]:PRICE per GPU, "
           "cpu[@KIND]:PRICE per job without GPU type (a100:4.1, a100@spot:1.6, cpu:0.05)"),
    Option("max_hourly_cost", float, None, "the most a Pool's workers may cost per hour together, by prices "
           "(a Pool's own max_hourly_cost wins); none by default"),
    Option("peer_timeout", float, 30.0, "seconds after which a TCP peer that stopped answering (its host lost or cut off) counts as gone (0: the kernel's defaults, which take minutes to hours)"),
    Option("heartbeat_timeout", float, 15.0, "seconds a pool worker may stay silent (no heartbeat, no message) before it counts as lost (frozen, or a task holding the GIL): it is stopped and its tasks run elsewhere; it sends a heartbeat every fifth of this (0: no heartbeats)"),
    Option("handshake_timeout", float, 10.0, "seconds a connection to a listener of the run (the hub, a manager server) has to authenticate before it is closed"),
    Option("start_timeout", float, 0.0, "seconds a job may take to reach its parent before it is failed (0: wait for the backend)"),
    Option("spare_jobs", int, None, "jobs started ahead and kept ready per kind of job, so that a Process.start() lands on one already running (default: the backend's choice, 1 on docker and ssh, 0 elsewhere; 0: none)"),
    Option("spare_timeout", float, 60.0, "seconds a spare job waits to be used before it is let go"),
    Option("status", bool, False, "show the program's state (pools, workers, tasks) to fiber top in another terminal of the same user; nothing is shown unless this or status_port is set"),
    Option("journal", str, None, "directory of the journal of a durable run: every finished Pool and executor call is recorded there, and a rerun of the program replays what it finds (docs/durable.md); unset: no journal"),
    Option("journal_wait", float, 0.0, "seconds a master waits for the journal's lease while another master of the program holds it, before it refuses to start (0: refuse at once)"),
    Option("program", str, None, "the name of the program in its journal, the same in each run that continues it; unset: the real path of its main module, in a notebook the notebook's path where its kernel knows it (a journal refuses a program without either)"),
    Option("seed", int, None, "the run's seed, from which each task's seed is derived (fiber_core.current_task); unset: random, kept in the journal when there is one"),
    Option("status_port", int, None, "also serve the status page on 127.0.0.1 at this port (0: any free port); its address, with the token that opens it, is printed to stderr"),
)


def init_key(key: str, section: str = "fiber") -> str:
    """The keyword of ``key`` of ``section`` for :func:`fiber_core.init`: ``key`` for a global
    one, ``<section>_<key>`` for a backend's (``docker_image``)."""
    return key if section == "fiber" else f"{section}_{key}"


def env_variable(key: str, section: str = "fiber") -> str:
    """The environment variable of ``key`` of ``section``: ``FIBER_BACKEND``, ``FIBER_DOCKER_IMAGE``."""
    return "FIBER_" + init_key(key, section).upper()


class Value:
    """A resolved value and where it came from (for ``fiber config``); equal to another with
    the same two. (Not a ``typing.NamedTuple``, for the reason :class:`Option` gives.)"""

    __slots__ = ("value", "source")

    def __init__(self, value: Any, source: str) -> None:
        self.value = value
        self.source = source

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Value) and (self.value, self.source) == (other.value, other.source)

    def __hash__(self) -> int:
        return hash((self.value, self.source))

    def __repr__(self) -> str:
        return f"Value({self.value!r}, {self.source!r})"


class Config:
    """The configuration of this process: call :meth:`get` to read a typed value."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._init: dict[str, Any] = {}
        self._file: configparser.ConfigParser | None = None
        self._file_read = False
        self._file_path: str | None = None
        self._backend_options: dict[str, tuple[Option, ...]] = {}
        self.generation = 0
        """Bumped by :meth:`init` and :meth:`reset`: what was resolved before is stale."""

    # -- sources -----------------------------------------------------------------

    def init(self, **kwargs: Any) -> None:
        """Set values in code (``fiber_core.init``); they beat variables and files."""
        known = self._known_keys()
        if not known.keys() >= kwargs.keys():
            plugins().backends()  # load the installed plugins: their options become known
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
                self.generation += 1

    def reset(self) -> None:
        """Forget values set by :meth:`init` and re-read ``.fiberconfig`` on next use."""
        with self._lock:
            self._init.clear()
            self._file = None
            self._file_read = False
            self._file_path = None
            self.generation += 1

    def register_backend_options(self, backend: str, options: Iterable[Option]) -> None:
        self._backend_options[backend] = tuple(options)

    def _is_unloaded_backend_key(self, key: str) -> bool:
        # init(docker_image=...) while fiber-docker is not installed: kept, checked once it is.
        prefix = key.split("_", 1)[0]
        return "_" in key and prefix in plugins().known_packages and prefix not in self._backend_options

    def _known_keys(self) -> dict[str, Option]:
        known = {o.name: o for o in GLOBAL_OPTIONS}
        for backend, options in self._backend_options.items():
            for o in options:
                known[f"{backend}_{o.name}"] = o
        return known

    def _read_file(self) -> configparser.ConfigParser | None:
        """``.fiberconfig`` of the working directory, read once (until :meth:`reset`); None
        if there is none, and then configparser is not imported (a job's start looks a
        setting up)."""
        with self._lock:
            if self._file_read:
                return self._file
            path = os.path.abspath(CONFIG_FILE)
            if os.path.exists(path):
                import configparser

                parser = configparser.ConfigParser(interpolation=None)
                try:
                    parser.read(path, encoding="utf-8")
                except configparser.Error as e:
                    raise ConfigError(
                        f"malformed {path}: {e}. It is an INI file: a [fiber] section "
                        "for global keys, a [<backend>] section per backend."
                    ) from None
                self._file_path = path
                self._file = parser
            self._file_read = True
            return self._file

    # -- reading -------------------------------------------------------------------

    def lookup(self, key: str, section: str = "fiber") -> Value:
        """Resolve ``key`` in ``section`` (``fiber`` or a backend name)."""
        full = init_key(key, section)
        option = {o.name: o for o in self.options(section)}.get(key)
        if option is None:
            raise ConfigError(f"unknown configuration key {full!r}")
        with self._lock:
            has_init, init_value = full in self._init, self._init.get(full)
        if has_init:
            return Value(option.parse(init_value, full, "init()"), "init()")
        env = env_variable(key, section)
        if env in os.environ:
            return Value(option.parse(os.environ[env], env, "environment"), f"env {env}")
        parser = self._read_file()
        if parser is not None and parser.has_option(section, key):
            where = f"{self._file_path} [{section}]"
            return Value(option.parse(parser.get(section, key), f"{key} in [{section}]", where), where)
        return Value(option.default, "default")

    def options(self, section: str = "fiber") -> tuple[Option, ...]:
        """The options of ``section``: the global ones for ``fiber``, else those of the backend
        whose settings section it is (none until its plugin is loaded)."""
        return GLOBAL_OPTIONS if section == "fiber" else self._backend_options.get(section, ())

    def sections(self) -> list[str]:
        """``fiber`` and the settings section of every backend registered so far."""
        return ["fiber", *sorted(self._backend_options)]

    def get(self, key: str, section: str = "fiber") -> Any:
        return self.lookup(key, section).value

    def backend_settings(self, backend: str) -> dict[str, Any]:
        """Every option of ``backend``, resolved and typed."""
        return {o.name: self.get(o.name, backend) for o in self._backend_options.get(backend, ())}

    def made_here(self, section: str, skip: Collection[str] = ()) -> dict[str, str]:
        """The settings of ``section`` (``fiber`` or a backend's) made on this machine, not
        defaults, as the environment variables that make them in another process: what
        ``fiber run`` forwards to the job that runs the program. ``skip``: names not forwarded."""
        env = {}
        for option in self.options(section):
            value = self.lookup(option.name, section)
            if option.name in skip or value.source == "default" or value.value is None:
                continue
            v = value.value
            env[env_variable(option.name, section)] = (",".join(v) if isinstance(v, list)
                                                       else ("1" if v else "0") if isinstance(v, bool) else str(v))
        return env

    def check_file(self) -> None:
        """Validate every key of ``.fiberconfig`` whose section is known."""
        parser = self._read_file()
        for section in parser.sections() if parser is not None else ():
            self.check_section(section)

    def check_section(self, section: str) -> None:
        """Validate the keys of ``[section]`` in ``.fiberconfig``, if the section is known.

        An unknown key is an error naming the known ones, so a misspelled setting (or a
        secret put where it does not belong) is refused instead of silently ignored.
        """
        parser = self._read_file()
        if parser is None or not parser.has_section(section):
            return
        if section == "fiber":
            names = {o.name for o in GLOBAL_OPTIONS}
        elif section in self._backend_options:
            names = {o.name for o in self._backend_options[section]}
        else:
            return
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



def plugins() -> Registry:
    """The process's registry of backends: the built-in one, the installed plugins, and each
    backend's options known to this configuration. The one way to look backends up."""
    global _registry
    if _registry is None:
        # Loaded on first use, on purpose: the contract, pluggy and the local backend cost a
        # job ~40 ms of its start, and a job that starts no process of its own needs none of them.
        from fiber_core.backends import local
        from fiber_core.runtime.registry import Registry  # see the comment above

        registry = Registry()
        registry.add_builtin(local, local.LocalBackend)
        registry.on_register(lambda cls: config.register_backend_options(cls.settings_section(), cls.options))
        _registry = registry
    return _registry


_registry: Registry | None = None


def selected_backend_name(explicit: str | None = None) -> str:
    """The backend chosen by argument > init() > FIBER_BACKEND > .fiberconfig > detected > local.

    *Detected* is what a plugin's :func:`~fiber_core.contract.hookspecs.fiber_detect_backend`
    says, asked only when nothing is configured (inside a pod, the Kubernetes plugin).
    """
    if explicit:
        return plugins().canonical(explicit)
    value = config.lookup("backend")
    if value.source == "default":
        detected = plugins().detect()
        if detected:
            return plugins().canonical(detected)
    try:
        return plugins().canonical(value.value)
    except UnknownBackendError as e:
        raise UnknownBackendError(f"{e} (backend set by {value.source})") from None


def likely_local_settings() -> dict[str, Any] | None:
    """The local backend's settings where the run will likely use it, before the plugins are
    loaded: no backend is set (one may still be detected) or ``local`` is; else None."""
    value = config.lookup("backend")
    if value.source != "default" and value.value != "local":
        return None
    # Not the local backend itself: the contract and pluggy it imports would delay the template.
    from fiber_core.backends.early import OPTIONS, SECTION

    config.register_backend_options(SECTION, OPTIONS)  # the local backend's, as the registry does
    return config.backend_settings(SECTION)


def create_backend(name: str, run_id: str, rundir: str | None = None) -> Backend:
    """A new instance of the backend ``name`` with its settings resolved now."""
    cls = plugins().get_class(name)
    config.check_section(cls.settings_section())
    backend = cls(config.backend_settings(cls.settings_section()), run_id, rundir)
    backend.peer_timeout = config.get("peer_timeout")
    return backend


def listen_host(backend: Backend) -> str:
    """The address this process listens on for the jobs of ``backend``: decided here only.

    The ``listen_host`` setting when given, else what the backend says its jobs reach.
    """
    return config.get("listen_host") or backend.get_listen_addr()
