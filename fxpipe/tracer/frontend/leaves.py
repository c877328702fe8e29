"""``--leaf``: which modules a user asked to keep whole, by class or path, on both front ends.

A leaf spec is a module class, a class name (``Block``, ``CausalSelfAttention``, or the
dotted ``models.gpt.Block``), a module path (``blocks.3.attn``) or a path pattern with
shell wildcards (``blocks.*.attn``). :func:`resolve_leaves` turns specs into module paths
of the model and refuses a spec that matches nothing, naming close matches, so a typo is
never silently ignored. The symbolic front end keeps those modules as ``call_module``
nodes; the export front end traces into them, and :func:`leaf_regions` gives the nodes
each one made, which the unit grouping keeps in one unit (so no stage boundary cuts it).
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable, Sequence

import torch.fx
import torch.nn as nn

from fxpipe.errors import TraceError
from fxpipe.graphmeta import PATH_KEY

__all__ = ["resolve_leaves", "leaf_regions"]

_WILDCARDS = frozenset("*?[")


def _class_names(module: nn.Module) -> tuple[str, ...]:
    cls = type(module)
    return cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"


def _matches(spec: type | str, path: str, module: nn.Module) -> bool:
    if isinstance(spec, type):
        return isinstance(module, spec)
    if spec == path or spec in _class_names(module):
        return True
    return bool(_WILDCARDS & set(spec)) and fnmatch.fnmatchcase(path, spec)


def resolve_leaves(model: nn.Module, leaves: Iterable[type | str]) -> tuple[str, ...]:
    """The module paths (model order) that ``leaves`` name; ``TraceError`` for a spec that names none."""
    named = [
        (path, m) for path, m in model.named_modules() if path
    ]  # the model itself is never a leaf
    chosen: set[str] = set()
    for spec in leaves:
        hits = [path for path, m in named if _matches(spec, path, m)]
        if not hits:
            raise TraceError(_no_match(spec, named))
        chosen.update(hits)
    return tuple(path for path, _ in named if path in chosen)


def _no_match(spec: type | str, named: Sequence[tuple[str, nn.Module]]) -> str:
    what = spec.__qualname__ if isinstance(spec, type) else spec
    classes = sorted({type(m).__name__ for _, m in named})
    close = difflib.get_close_matches(what, classes + [p for p, _ in named], n=3, cutoff=0.6)
    hint = (
        f"; did you mean {' or '.join(repr(c) for c in close)}?"
        if close
        else f"; its module classes are {', '.join(classes[:8])}{' …' if len(classes) > 8 else ''}"
    )
    return f"--leaf {what!r} matches no module class or path of the model{hint}"


def leaf_regions(gm: torch.fx.GraphModule, paths: Sequence[str]) -> list[set[str]]:
    """For each leaf path, the compute nodes its module (or its submodules) made: one unit each."""
    regions: dict[str, set[str]] = {p: set() for p in paths}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        path = node.meta.get(PATH_KEY, "")
        for leaf in paths:
            if path == leaf or path.startswith(leaf + "."):
                regions[leaf].add(node.name)
    return [r for r in regions.values() if len(r) > 1]
