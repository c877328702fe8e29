"""Readable names for what a stage holds: boundary tensors and module ranges.

A tensor that crosses stages is named after the module call it comes from:
``h_3_out`` is what ``transformer.h.3`` returned, ``h_3_mlp_out`` what its MLP returned,
``h_3_add`` an ``add`` inside block 3 that is not its result, and a value made at the
top level keeps its operator's name (``add``). Where the source names a value (Note [names
from the source] in :mod:`fxpipe.codegen.render.statements`) that name replaces the operator's
(``h_3_hidden_states``), and a name only one value has stands alone: ``causal_mask``, and
``logits`` for what ``logits = self.lm_head(...)`` assigns rather than ``lm_head_out``. Module paths are shortened to the part a
reader needs (``model.transformer.h.3.mlp`` -> ``h_3_mlp``), or kept whole where two
paths would shorten alike. Names are unique and depend only on the traced graph, so
every stage and the manifest agree on them and a rebuild gives the same names.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

import torch.fx as fx

from fxpipe.codegen.graph.scopes import Scope, is_indexer, scope_members, scope_stack
from fxpipe.codegen.render.statements import source_names
from fxpipe.graphmeta import PATH_KEY

__all__ = ["short_paths", "boundary_names", "describe_modules", "module_ranges", "unique_name"]

_COMPUTE = ("call_function", "call_method", "call_module")


def unique_name(wanted: str, used: set[str], first: int = 2) -> str:
    """``wanted``, or ``wanted_<n>`` with the least ``n >= first`` not in ``used``; the name is added to ``used``."""
    candidate, n = wanted, first
    while candidate in used:
        candidate = f"{wanted}_{n}"
        n += 1
    used.add(candidate)
    return candidate


def _short(path: str) -> str:
    parts = path.split(".")
    digits = [i for i, p in enumerate(parts) if p.isdigit()]
    start = max(digits[-1] - 1, 0) if digits else len(parts) - 1
    return "_".join(parts[start:])


def _identifier(text: str) -> str:
    text = re.sub(r"\W", "_", text)
    return f"layer_{text}" if text[:1].isdigit() else text


def short_paths(paths: Iterable[str]) -> dict[str, str]:
    """``path -> identifier``: the path from its last named list onward (``h_3_mlp``), unique among ``paths``."""
    wanted = {p: _identifier(_short(p)) for p in set(paths) if p}
    count: dict[str, int] = {}
    for short in wanted.values():
        count[short] = count.get(short, 0) + 1
    return {p: s if count[s] == 1 else _identifier(p.replace(".", "_")) for p, s in wanted.items()}


def _base(name: str) -> str:
    return re.sub(r"(_\d+)+$", "", name) or name


def boundary_names(gm: fx.GraphModule, crossing: Iterable[str] | None = None) -> dict[str, str]:
    """``node name -> readable name`` for every placeholder and the compute nodes named in ``crossing``
    (all of them by default), unique among those."""
    nodes = [n for n in gm.graph.nodes if n.op in _COMPUTE]
    members = scope_members(nodes)
    for (
        node
    ) in nodes:  # a leaf module call is a scope of its own: its result is that module's output
        if node.op == "call_module":
            members[_leaf(node)] = [node, *(u for u in node.users if is_indexer(u))]
    shorts = short_paths(
        [path for _, path in members] + [str(n.meta.get(PATH_KEY, "")) for n in nodes]
    )
    outputs = {scope: _outputs(ms) for scope, ms in members.items()}
    source = _SourceNames(gm.graph)
    result: dict[str, str] = {}
    used: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            result[node.name] = unique_name(node.name, used)
    wanted = None if crossing is None else set(crossing)
    for node in nodes:
        if wanted is None or node.name in wanted:
            result[node.name] = unique_name(
                _identifier(_name_of(node, outputs, shorts, source)), used
            )
    return result


def _leaf(node: fx.Node) -> Scope:
    return (f"leaf:{node.target}", str(node.target))


def _outputs(members: list[fx.Node]) -> list[fx.Node]:
    inside = set(members)
    return [n for n in members if any(u not in inside for u in n.users)]


class _SourceNames:
    """What the source calls a traced graph's values (Note [names from the source] in
    :mod:`fxpipe.codegen.render.statements`), and which of those names only one value has."""

    def __init__(self, graph: fx.Graph) -> None:
        self.names = source_names(graph)
        counts: dict[str, int] = {}
        for name in self.names.values():
            counts[name] = counts.get(name, 0) + 1
        self.distinctive = {name for name, n in counts.items() if n == 1}

    def of(self, node: fx.Node) -> str | None:
        return self.names.get(node)


def _name_of(
    node: fx.Node,
    outputs: Mapping[Scope, list[fx.Node]],
    shorts: Mapping[str, str],
    source: _SourceNames,
) -> str:
    owners = list(scope_stack(node))
    indexed = node.args[0] if is_indexer(node) else node
    if isinstance(indexed, fx.Node) and indexed.op == "call_module":
        owners.append(_leaf(indexed))
    for scope in owners:  # the outermost call whose result this node is
        outs = outputs[scope]
        if node in outs:
            prefix = shorts[scope[1]]
            named = source.of(node)
            if named is not None and named in source.distinctive:
                return named
            if len(outs) == 1:
                return f"{prefix}_out"
            if is_indexer(node):
                return f"{prefix}_out_{node.args[1]}"
            return f"{prefix}_{_base(node.name)}"
    path = str(node.meta.get(PATH_KEY, ""))
    named = source.of(node)
    if named is not None and named in source.distinctive:
        return named
    what = named or _base(node.name)
    return f"{shorts[path]}_{what}" if path in shorts else what


def module_ranges(paths: Iterable[str]) -> list[str]:
    """Paths that differ only in one layer number, written once with the numbers as ranges.

    ``["h.0", "h.1", "h.2", "ln_f"]`` -> ``["h.0-2", "ln_f"]``; ``["h.0.mlp", "h.1.mlp"]`` -> ``["h.0-1.mlp"]``.
    """
    groups: dict[tuple[str, str], list[int]] = {}
    for path in paths:
        parts = path.split(".")
        digits = [i for i, p in enumerate(parts) if p.isdigit()]
        if not digits:
            groups.setdefault((path, ""), [])
            continue
        i = digits[-1]
        groups.setdefault((".".join(parts[:i]), ".".join(parts[i + 1 :])), []).append(int(parts[i]))
    out = []
    for (prefix, suffix), numbers in groups.items():
        if not numbers:
            out.append(prefix)
            continue
        runs: list[list[int]] = []
        for n in numbers:
            if runs and n == runs[-1][-1] + 1:
                runs[-1].append(n)
            else:
                runs.append([n])
        for run in runs:
            number = str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"
            out.append(".".join(p for p in (prefix, number, suffix) if p))
    return out


def describe_modules(
    gm: fx.GraphModule, owned: set[str], module_order: Mapping[str, int]
) -> tuple[list[str], list[str]]:
    """``(whole, partial)`` module paths of a stage that owns the nodes named ``owned``.

    ``whole``: the outermost modules all of whose nodes the stage owns; ``partial``: modules
    split across stages whose own (not a submodule's) nodes the stage partly owns.
    """
    mine: dict[str, int] = {}
    total: dict[str, int] = {}
    direct: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op not in _COMPUTE:
            continue
        path = str(node.meta.get(PATH_KEY, ""))
        parts = path.split(".") if path else []
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            total[prefix] = total.get(prefix, 0) + 1
            if node.name in owned:
                mine[prefix] = mine.get(prefix, 0) + 1
        if path and node.name in owned:
            direct[path] = direct.get(path, 0) + 1
    whole = [
        p
        for p in mine
        if mine[p] == total[p]
        and mine.get(p.rpartition(".")[0], 0) != total.get(p.rpartition(".")[0], -1)
    ]
    partial = [p for p in direct if mine[p] != total[p]]
    order = lambda p: (module_order.get(p, len(module_order)), p)
    return module_ranges(sorted(whole, key=order)), module_ranges(sorted(partial, key=order))
