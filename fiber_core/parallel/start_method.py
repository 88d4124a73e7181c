"""The start method name ``"fiber"`` in the stdlib's table, registered without loading Fiber's context.

``import fiber_core`` registers it, and every job imports ``fiber_core``: so this module
imports only the stdlib's ``multiprocessing.context`` (which the errors of
:mod:`fiber_core.base.errors` derive from, so it is loaded in any case), and Fiber's
context (the queues, the Pipe, the process module) is imported the first time the name
is looked up.
"""

from __future__ import annotations

import multiprocessing.context

TYPE_CHECKING = False
if TYPE_CHECKING:
    from fiber_core.parallel.context import FiberContext


def _fiber_context() -> FiberContext:
    from fiber_core.parallel.context import _default  # on first use: the whole API behind it

    return _default


class _StartMethods(dict):
    """The stdlib's table of start methods, with the same entries, that also finds ``"fiber"``.

    ``"fiber"`` is found (``__missing__``) but is not one of its keys, so what lists the
    table is unchanged: CPython 3.14's ``multiprocessing.get_all_start_methods()`` lists
    its keys, where 3.10 to 3.13 list fixed names.
    """

    def __missing__(self, key: str) -> FiberContext:
        if key == "fiber":
            return _fiber_context()
        raise KeyError(key)


def register_start_method() -> bool:
    """Make the stdlib's ``multiprocessing.get_context("fiber")`` return Fiber's context.

    Libraries that take a start method *name* (gymnasium's ``AsyncVectorEnv(context=)``,
    Stable-Baselines3's ``SubprocVecEnv(start_method=)``) look it up with the stdlib's
    ``get_context``, which reads the table ``multiprocessing.context._concrete_contexts``
    (a module global, looked up the same way, in CPython 3.10 to 3.14). Fiber replaces it,
    when ``fiber_core`` is imported, with a table of the same entries that also finds
    ``"fiber"`` (:class:`_StartMethods`), so such a library runs its processes as Fiber
    jobs, unpatched. Nothing else changes: the stdlib's default start method and
    ``multiprocessing.get_all_start_methods()`` stay as they were (on 3.14 too, which lists
    the table), and ``multiprocessing.set_start_method("fiber")`` is refused (see
    ``FiberContext._check_available``).

    Returns False, registering nothing, where this Python keeps no such table or another
    package has taken the name: ``get_context("fiber")`` then raises the stdlib's
    ``ValueError: cannot find context for 'fiber'``.
    """
    table = getattr(multiprocessing.context, "_concrete_contexts", None)
    if not isinstance(table, dict):
        return False
    current = dict.get(table, "fiber")
    if current is not None and type(current).__module__ != "fiber_core.parallel.context":
        return False
    if isinstance(table, _StartMethods):
        table.pop("fiber", None)
    else:
        multiprocessing.context._concrete_contexts = _StartMethods(  # type: ignore[attr-defined]  # noqa: SLF001 - the stdlib's table of start methods, which offers no public way to add one
            (name, ctx) for name, ctx in table.items() if name != "fiber")
    return True
