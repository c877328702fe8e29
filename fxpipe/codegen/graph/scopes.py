"""Which module calls a node of a normalized graph was made in, read from ``nn_module_stack``.

Both front ends record, on every node they trace, the stack of module calls it was made
in (``node.meta["nn_module_stack"]``: call key -> (module path, class)). A ``Scope`` is
one entry: the call's key (unique per call under export, ``blocks.0@1`` for a second
call) and the module path. The root module and, for a leaf's ``call_module`` node, the
leaf itself are left out: the first is the stage, the second is the call.
Nodes that carry no stack take one from elsewhere: an indexer (``getitem`` on a tuple)
shares its source's stack; anything else is at the top level.
"""

from __future__ import annotations

import operator
import re
from typing import Iterable

import torch.fx as fx


__all__ = ["Scope", "scope_stack", "is_indexer", "scope_members"]

Scope = tuple[str, str]  # (call key, module path)
_IGNORED = "_empty_nn_module_stack_from_metadata_hook"
_CALL_SUFFIX = re.compile(r"@\d+$")


def is_indexer(node: fx.Node) -> bool:
    """``x[k]`` / ``getattr(x, name)`` with a constant key on a computed value."""
    return (
        node.op == "call_function"
        and node.target in (operator.getitem, getattr)
        and len(node.args) == 2
        and isinstance(node.args[0], fx.Node)
        and node.args[0].op in ("call_function", "call_method", "call_module")
        and not isinstance(node.args[1], fx.Node)
    )


def _own_stack(node: fx.Node) -> tuple[Scope, ...] | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    entries: list[Scope] = []
    for key, value in stack.items():
        if key == _IGNORED:
            continue
        path = _CALL_SUFFIX.sub("", value[0] if isinstance(value, tuple) else str(value))
        if path:
            entries.append((str(key), path))
    while node.op == "call_module" and entries and entries[-1][1] == str(node.target):
        entries.pop()
    return tuple(entries)


def scope_stack(node: fx.Node) -> tuple[Scope, ...]:
    """The module calls ``node`` was made in, outermost first (see the module docstring)."""
    own = _own_stack(node)
    if own is not None:
        return own
    if is_indexer(node):
        source = node.args[0]
        assert isinstance(source, fx.Node)
        return scope_stack(source)
    return ()


def scope_members(nodes: Iterable[fx.Node]) -> dict[Scope, list[fx.Node]]:
    """Every scope of the given nodes and its nodes, in the given order."""
    members: dict[Scope, list[fx.Node]] = {}
    for node in nodes:
        for scope in scope_stack(node):
            members.setdefault(scope, []).append(node)
    return members
