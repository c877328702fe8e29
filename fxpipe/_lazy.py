"""Package attributes imported on first use (PEP 562), so importing a package costs only what is used."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    namespace: dict[str, Any],
    names: dict[str, str],
    submodules: Iterable[str] = (),
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for the package whose ``globals()`` is ``namespace``:
    ``name`` is imported from its submodule ``names[name]`` (a path relative to the package,
    e.g. ``"tracer.api"``, or an absolute one starting with ``fxpipe.``) when first asked for,
    then kept; a name in ``submodules`` is that submodule itself."""
    package = namespace["__name__"]
    modules = frozenset(submodules)

    def __getattr__(name: str) -> Any:
        if name in modules:
            value = importlib.import_module(f"{package}.{name}")
        elif name in names:
            module = (
                names[name] if names[name].startswith("fxpipe.") else f"{package}.{names[name]}"
            )
            value = getattr(importlib.import_module(module), name)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names) | modules)

    return __getattr__, __dir__
