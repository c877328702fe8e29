"""Package attributes imported on first use (PEP 562), so importing a package costs only what is used.

Note [one list of lazy names]: a package's ``if TYPE_CHECKING:`` block of ``from fxpipe.x
import name`` statements is its list of exports: type checkers and editors read it, and
``type_checking_exports`` reads the same statements (the file's AST, once, at import) for the
map that ``lazy_exports`` imports from. A second hand-written map drifted from it
(``fxpipe.runtime.RunRecord`` named a module that had been renamed).
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = ["lazy_exports", "type_checking_exports"]


def type_checking_exports(init_file: str) -> dict[str, str]:
    """``{name: absolute module}`` of the ``from fxpipe... import name`` statements under
    ``if TYPE_CHECKING:`` in the package file ``init_file`` (its ``__file__``)."""
    tree = ast.parse(Path(init_file).read_text(encoding="utf-8"), filename=init_file)
    names: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) in (
            "TYPE_CHECKING",
            "typing.TYPE_CHECKING",
        ):
            for statement in node.body:
                assert isinstance(statement, ast.ImportFrom) and statement.level == 0, (
                    f"{init_file}: only `from fxpipe... import name` under TYPE_CHECKING "
                    "(Note [one list of lazy names])"
                )
                for alias in statement.names:
                    names[alias.asname or alias.name] = str(statement.module)
    return names


def lazy_exports(
    namespace: dict[str, Any],
    names: dict[str, str] | None = None,
    submodules: Iterable[str] = (),
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for the package whose ``globals()`` is ``namespace``:
    ``name`` is imported from its submodule ``names[name]`` (a path relative to the package,
    e.g. ``"tracer.api"``, or an absolute one starting with ``fxpipe.``) when first asked for,
    then kept; a name in ``submodules`` is that submodule itself. ``names`` left out: the
    package's ``TYPE_CHECKING`` imports (Note [one list of lazy names])."""
    package = namespace["__name__"]
    if names is None:
        names = type_checking_exports(namespace["__file__"])
    table = names
    modules = frozenset(submodules)

    def __getattr__(name: str) -> Any:
        if name in modules:
            value = importlib.import_module(f"{package}.{name}")
        elif name in table:
            module = (
                table[name] if table[name].startswith("fxpipe.") else f"{package}.{table[name]}"
            )
            value = getattr(importlib.import_module(module), name)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table) | modules)

    return __getattr__, __dir__
