"""The hooks a Fiber plugin may implement.

Plugins are found through the ``fiber`` entry-point group::

    [project.entry-points.fiber]
    docker = "fiber_docker.plugin"

The named module (or object) is registered with pluggy and its ``fiber_*``
functions marked with :data:`hookimpl` are called. A hook is a broadcast to every
plugin: use hooks to *announce* things. A backend is a stateful object that the
user picks, so calls on jobs never go through hooks: they are plain method calls
on the :class:`fiber_core.contract.backend.Backend` instance.

The hooks: :func:`fiber_register_backends` (what a backend plugin implements),
:func:`fiber_add_commands`, :func:`fiber_run_launchers`, :func:`fiber_detect_backend` and
:func:`fiber_journal_store`. A function marked
with :data:`hookimpl` under any other name (``fiber_register_backend``) is a
:class:`~fiber_core.base.errors.PluginError` when plugins load, naming the plugin
and the hook; an unmarked function is not a hook and is never called.

``FIBER_DISABLE_PLUGIN_AUTOLOAD=1`` skips the entry points: only the built-in
backends and plugins registered by hand are known. Tests and programs that embed
a backend register one by hand, module or object alike::

    from fiber_core.runtime.config import plugins
    plugins().register_plugin(my_plugin_module, name="shell")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable, Mapping

    from fiber_core.contract.backend import Backend
    from fiber_core.contract.store import ObjectStore


hookspec = pluggy.HookspecMarker("fiber")


"""Marker for hook specifications (used by this module only)."""


hookimpl = pluggy.HookimplMarker("fiber")


"""Marker for hook implementations: decorate your plugin's ``fiber_*`` functions."""


@hookspec
def fiber_register_backends(register: Callable[[type[Backend]], None]) -> None:
    """Register the backends this plugin provides.

    Called once per process, the first time Fiber needs to know the installed
    backends (selecting one, or ``fiber backends``). Every plugin is called; the
    return value is ignored.

    :param register: call ``register(MyBackend)`` once per backend class. The
        class must subclass :class:`fiber_core.contract.backend.Backend` and set ``name``
        (lowercase) and, optionally, ``aliases``. Registering a name twice is an
        error unless it is the same class.

    Example, the whole plugin module of a third-party backend::

        from fiber_core.contract import hookimpl
        from .backend import NomadBackend

        @hookimpl
        def fiber_register_backends(register):
            register(NomadBackend)
    """


@hookspec
def fiber_add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add subcommands to the ``fiber`` command line.

    Called once when ``fiber`` starts, for every plugin. Each subcommand's parser
    sets ``func`` (``parser.set_defaults(func=handler)``); ``handler(args)``
    returns the exit status. (``fiber run`` is the core's: a plugin adds a launcher with
    :func:`fiber_run_launchers`.)

    :param subparsers: the object ``argparse`` returns from ``add_subparsers()``.
    """


@hookspec
def fiber_run_launchers() -> Mapping[str, Callable[[argparse.ArgumentParser], None]] | None:
    """Name the backends on which ``fiber run`` can launch a whole program, with how.

    ``fiber run [--backend NAME] [OPTIONS] CMD...`` runs ``CMD`` itself as a job of a backend
    (a pod, a Batch job), where its processes become that backend's jobs. Called once when
    ``fiber run`` starts, for every plugin. ``fiber run`` picks the backend (its ``--backend``,
    else the configured backend when a plugin launches on it, else ``kubernetes``), builds a
    parser of its own for it that already has ``--backend`` and the positional ``cmd``, and
    calls that backend's function with it: the function adds the backend's options (each
    launcher has its own parser, so two plugins may both have ``--image``) and sets ``func``
    (``parser.set_defaults(func=handler)``); ``handler(args)`` returns the exit status.
    Without any launcher, ``fiber run`` says which distribution to install.

    :return: ``{backend name: add_options}``, the names as registered (not aliases); a name
        that two plugins claim is a :class:`~fiber_core.base.errors.PluginError`.
        fiber-k8s answers ``kubernetes``, fiber-aws ``aws-batch``.
    """


@hookspec(firstresult=True)
def fiber_detect_backend() -> str | None:
    """Name the backend this process should use because of where it runs.

    Called once per process when no backend is configured (no argument, ``init()``,
    ``FIBER_BACKEND`` or ``.fiberconfig``), before falling back to ``local``. The
    first non-``None`` answer wins. Keep it cheap: read the environment, do not
    call a cluster. The Kubernetes plugin answers ``"kubernetes"`` inside a pod.

    :return: a backend name or alias, or ``None`` to leave the choice to others.
    """


@hookspec(firstresult=True)
def fiber_journal_store(url: str) -> ObjectStore | None:
    """Open the object storage that a ``journal`` setting names, such as ``s3://bucket/prefix``.

    Called once per program, on its first Pool or executor call, when the setting has a
    scheme (``://``). The first non-``None`` answer wins; with none, the program stops with
    an error that names the setting. Do not reach the storage here (its first request is
    the journal's): credentials and endpoints come from where the storage's own client
    reads them. fiber-aws answers ``s3://``.

    :param url: the setting as given.
    :return: an :class:`~fiber_core.contract.store.ObjectStore`, or ``None`` for a scheme
        this plugin does not serve.
    """
