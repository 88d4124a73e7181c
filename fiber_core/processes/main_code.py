"""The program's main module compiled once, in the parent, for the jobs that import it.

A job imports the program's main module as ``__mp_main__``, as multiprocessing's spawn
does, and Python never keeps bytecode for a main module: every job would compile its
source again (2-3 ms for a script of 300 lines, each job on every host). The parent
compiles it once (:func:`compiled`) and sends the code in the job's prelude, with a
digest of the source it compiled; a job runs that code only where its own copy of the
file has the same digest, and on an interpreter whose bytecode is the same
(:func:`code_for`); anywhere else it compiles its own copy, as before. The prelude comes
from the authenticated parent, as the process object does, so running its code trusts
nobody new; nothing is written to disk.
"""

from __future__ import annotations

import marshal
import os
import sys

from fiber_core.base.blake2 import blake2b

TYPE_CHECKING = False  # typing's own, without importing typing: a job starts without it
if TYPE_CHECKING:
    from types import CodeType

TAG = (sys.implementation.cache_tag,
       getattr(sys.modules.get("_frozen_importlib_external"), "MAGIC_NUMBER", None),
       sys.flags.optimize)
"""Where shipped code may run: where a ``.pyc`` file of it would be used (its name's tag and
optimization level, and the bytecode's magic number, the same across a Python version's
patch releases); the magic number is read from the import system itself, since
:mod:`importlib.util` would cost a job a millisecond. None in a part: nothing is shipped
from, or run on, such an interpreter."""

MAX_BYTES = 1 << 20
"""Marshalled code above this is not sent: every job's prelude carries it."""

Shipped = tuple  # (TAG, digest of the source, marshalled code)

_cache: tuple[tuple[str, int, int], Shipped | None] | None = None


def _digest(source: bytes) -> bytes:
    return blake2b(source, digest_size=16, person=b"fiber-main").digest()


def compiled(ref: tuple[str, str] | None) -> Shipped | None:
    """The main module that ``ref`` names (as a job gets it: ``("path", file)`` or
    ``("name", module)``) compiled here, to ship to jobs. None where there is nothing to
    ship: no file, not a source file (a module by name has its ``.pyc``), unreadable, a
    syntax error (the job then says why), too big. Compiled again only when the file
    changed (its mtime or size)."""
    global _cache
    if ref is None or ref[0] != "path" or not ref[1].endswith((".py", ".pyw")) or None in TAG:
        return None
    path = ref[1]
    try:
        st = os.stat(path)
        key = (path, st.st_mtime_ns, st.st_size)
        if _cache is not None and _cache[0] == key:
            return _cache[1]
        with open(path, "rb") as f:
            source = f.read()
        code = marshal.dumps(compile(source, path, "exec", dont_inherit=True))
    except (OSError, SyntaxError, ValueError):
        return None
    shipped = (TAG, _digest(source), code) if len(code) <= MAX_BYTES else None
    _cache = (key, shipped)
    return shipped


def code_for(source: bytes, where: str, shipped: Shipped | None) -> CodeType:
    """The code of the main module whose source (at ``where``) is ``source``: the
    parent's if it compiled the same source for this interpreter, else compiled here."""
    # (never shipped from a TAG with None in it: that cannot equal an interpreter's own)
    if shipped is not None and shipped[0] == TAG and shipped[1] == _digest(source):
        return marshal.loads(shipped[2])  # type: ignore[no-any-return]
    return compile(source, where, "exec", dont_inherit=True)
