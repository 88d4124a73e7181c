"""What a module declares for type checkers only, read from its source (a record made with
``collections.namedtuple`` at run time and declared as a ``typing.NamedTuple`` under
``TYPE_CHECKING``, so that the two can be compared)."""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType


def declared_fields(module: ModuleType, name: str) -> tuple[str, ...]:
    """The annotated fields of class ``name`` as ``module``'s source declares it."""
    tree = ast.parse(Path(module.__file__ or "").read_text())
    declared = next(node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == name)
    return tuple(stmt.target.id for stmt in declared.body
                 if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name))
