"""Finding backends: the built-in ones and plugins from the ``fiber`` entry-point group.

Plugins are loaded once per process, the first time a backend other than a built-in
one is asked for (or the list of all of them). ``FIBER_DISABLE_PLUGIN_AUTOLOAD=1``
turns the entry-point scan off: only built-in backends and plugins registered by
hand (:meth:`Registry.register_plugin`) are known, as ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``
does for pytest. A plugin that implements a hook Fiber does not define (a misspelled
``fiber_*`` name) is an error at load, naming the plugin and the hook.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType

import pluggy

from fiber_core.base.errors import PluginError, UnknownBackendError
from fiber_core.base.install import (
    KNOWN_BACKENDS,
    KNOWN_PACKAGES,
    install_command,
    installed_version,
)
from fiber_core.contract import hookspecs
from fiber_core.contract.backend import Backend

ENTRY_POINT_GROUP = "fiber"
ENV_DISABLE_AUTOLOAD = "FIBER_DISABLE_PLUGIN_AUTOLOAD"


@dataclass(frozen=True)
class AbsentBackend:
    """A backend the project publishes that is not registered here: what ``fiber backends`` says of it."""

    name: str
    package: str
    advice: str
    """How to get it: the install command, or why the installed package did not register it."""


@dataclass(frozen=True)
class BackendInfo:
    """What ``fiber backends`` shows of one registered backend."""

    name: str
    cls: type[Backend]
    aliases: tuple[str, ...]
    package: str
    version: str


class BackendRegistrar:
    """The ``register`` object handed to :func:`~fiber_core.backends.local.fiber_register_backends`."""

    def __init__(self) -> None:
        self._by_name: dict[str, type[Backend]] = {}
        self._canonical: dict[str, str] = {}
        self._dist: dict[str, str | None] = {}
        self.current_dist: str | None = None
        self.current_plugin: object | None = None  # its distribution is looked up if needed

    def __call__(self, backend: type[Backend]) -> None:
        if not (isinstance(backend, type) and issubclass(backend, Backend)):
            raise TypeError(f"register() takes a Backend subclass, not {backend!r}")
        name = getattr(backend, "name", None)
        if not isinstance(name, str) or not name or name != name.lower():
            raise TypeError(f"{backend.__qualname__}.name must be a lowercase string, got {name!r}")
        for key in (name, *backend.aliases):
            other = self._by_name.get(key)
            if other is not None and other is not backend:
                raise ValueError(
                    f"backend name {key!r} registered twice: {other.__module__}.{other.__qualname__} "
                    f"and {backend.__module__}.{backend.__qualname__}"
                )
            self._by_name[key] = backend
            self._canonical[key] = name
        # Only the class's own ``package``: a subclass of LocalBackend is not fiber-core.
        self._dist[name] = vars(backend).get("package") or self.current_dist or (
            _dist_name(self.current_plugin) if self.current_plugin is not None else None)

    def lookup(self, key: str) -> type[Backend] | None:
        """The backend registered under ``key`` (its name or an alias), if any."""
        return self._by_name.get(key)

    def by_name(self) -> list[tuple[str, type[Backend]]]:
        """Each registered backend once, under its own name (no alias), sorted by name."""
        return sorted((n, c) for n, c in self._by_name.items() if self._canonical[n] == n)

    def distribution(self, name: str) -> str | None:
        """The distribution that registered the backend ``name``, if known."""
        return self._dist.get(name)


class Registry:
    """Loads plugins once and answers which backends exist."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._registrar: BackendRegistrar | None = None
        self._plugins_loaded = False
        self._builtins: dict[str, tuple[ModuleType, type[Backend]]] = {}
        self._listeners: list[Callable[[type[Backend]], None]] = []
        self.pm = pluggy.PluginManager("fiber")
        self.pm.add_hookspecs(hookspecs)

    def add_builtin(self, plugin: ModuleType, backend: type[Backend]) -> None:
        """Make ``backend`` (registered by the plugin module ``plugin``) known without a scan.

        A built-in backend is selected without loading any installed plugin, so a
        program on the default backend never imports them.
        """
        with self._lock:
            self._builtins[backend.name] = (plugin, backend)
            listeners = list(self._listeners)
        for listener in listeners:
            listener(backend)

    def on_register(self, listener: Callable[[type[Backend]], None]) -> None:
        """Call ``listener(cls)`` for every backend class: a built-in one at once (it is used
        without loading the plugins), the plugins' once they are loaded."""
        with self._lock:
            self._listeners.append(listener)
            builtins = [cls for _, cls in self._builtins.values()]
        for cls in builtins:
            listener(cls)

    def _load_plugins(self) -> None:
        """Register the built-in and installed plugin modules with pluggy (once).

        Cheap on purpose: plugin modules import their backend classes only when asked to
        register them (:meth:`_load`), so asking a plugin which backend to use does not.
        """
        with self._lock:
            if self._plugins_loaded:
                return
            for name, (module, _cls) in self._builtins.items():
                if not self.pm.has_plugin(name):  # a reload after register_plugin()
                    self.pm.register(module, name=name)
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if self._autoload() else ():
                if ep.name in self._builtins or self.pm.has_plugin(ep.name):
                    continue
                try:
                    plugin = ep.load()
                except Exception as e:  # a broken plugin must not break the others
                    warnings.warn(f"fiber plugin {ep.name!r} ({ep.value}) failed to load: {e}", stacklevel=2)
                    continue
                self.pm.register(plugin, name=ep.name)
            self._check_hooks()
            self._plugins_loaded = True

    def _load(self) -> BackendRegistrar:
        self._load_plugins()
        with self._lock:
            if self._registrar is not None:
                return self._registrar
            registrar = BackendRegistrar()
            for impl in self.pm.hook.fiber_register_backends.get_hookimpls():
                # Not _dist_name(impl.plugin) here: it scans every installed distribution
                # (~0.3 s), and a backend that declares its ``package`` does not need it.
                registrar.current_plugin = impl.plugin
                impl.function(register=registrar)
            registrar.current_plugin = None
            for _, cls in registrar.by_name():
                for listener in self._listeners:
                    listener(cls)
            self._registrar = registrar
            return registrar

    def _check_hooks(self) -> None:
        """A ``fiber_*`` function that is not a known hook is a misspelling: say so at load."""
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as e:
            raise PluginError(
                f"fiber plugin {self.pm.get_name(e.plugin)!r} implements a hook that Fiber does not "
                f"define: {e}. The hooks are listed in fiber_core.contract.hookspecs"
            ) from None

    @staticmethod
    def _autoload() -> bool:
        return os.environ.get(ENV_DISABLE_AUTOLOAD, "").strip().lower() in ("", "0", "false", "no")

    @property
    def known_packages(self) -> dict[str, str]:
        """Backends the project publishes, by name, with the distribution that provides each."""
        return KNOWN_PACKAGES

    def detect(self) -> str | None:
        """The backend a plugin says this process should use where it runs, if any."""
        self._load_plugins()
        return self.pm.hook.fiber_detect_backend()

    def register_plugin(self, plugin: object, name: str | None = None) -> None:
        """Register a plugin object by hand (tests, embedded backends), then reload.

        A plugin with a misspelled hook is refused at once (:class:`PluginError`).
        """
        with self._lock:
            self.pm.register(plugin, name=name)
            try:
                self._check_hooks()
            except PluginError:
                self.pm.unregister(plugin)  # refused whole: nothing of it stays registered
                raise
            self._registrar = None

    def backends(self) -> list[BackendInfo]:
        reg = self._load()
        out = []
        for name, cls in reg.by_name():
            package = reg.distribution(name) or "fiber-core"
            try:
                version = importlib.metadata.version(package)
            except importlib.metadata.PackageNotFoundError:
                version = "(not installed)"
            out.append(BackendInfo(name, cls, tuple(cls.aliases), package, version))
        return out

    def get_class(self, name: str) -> type[Backend]:
        key = name.strip().lower()
        builtin = self._builtins.get(key)
        if builtin is not None and self._registrar is None:
            return builtin[1]  # a built-in backend needs no plugin: do not import every installed one
        reg = self._load()
        cls = reg.lookup(key)
        if cls is None:
            installed = ", ".join(n for n, _ in reg.by_name())
            package = KNOWN_PACKAGES.get(key)
            advice = f"{package} provides it: {self.advice(package)}" if package else (
                "a third-party backend is installed with its own package (see its docs)"
            )
            raise UnknownBackendError(f"unknown backend {name!r} (installed: {installed}); {advice}")
        return cls

    def absent(self) -> list[AbsentBackend]:
        """The backends the project publishes that are not registered here, with how to get each."""
        reg = self._load()
        return [AbsentBackend(name, package, self.advice(package))
                for name, package in sorted(KNOWN_BACKENDS.items()) if reg.lookup(name) is None]

    def advice(self, package: str) -> str:
        """How to get the backends of ``package``, one of the project's distributions, here."""
        version = installed_version(package)
        if version is None:
            return install_command(package)
        if not self._autoload():
            return f"{package} {version} is installed; {ENV_DISABLE_AUTOLOAD} keeps it from loading"
        return f"{package} {version} is installed but its plugin did not load (see the warning)"

    def canonical(self, name: str) -> str:
        return self.get_class(name).name


def _dist_name(plugin: object) -> str | None:
    module = getattr(plugin, "__name__", None) or type(plugin).__module__
    top = module.split(".")[0]
    dists = _packages_distributions().get(top)
    return dists[0] if dists else None


@functools.lru_cache(maxsize=1)
def _packages_distributions() -> Mapping[str, list[str]]:
    return importlib.metadata.packages_distributions()
