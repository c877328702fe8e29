"""Group the nodes of a normalized graph into units, the pieces the partitioner places.

Rules, applied in graph order (so every unit is a run of consecutive nodes and the
unit graph is acyclic by construction):

- consecutive nodes with the same owning module path form one unit (a leaf module call
  is one node, so it is one unit unless the same leaf is called again right after);
- a ``getitem``/``getattr`` on a computed value joins the unit of that value, so tuples
  never cross a unit boundary (``normalize.group_getitems`` put it right after);
- top-level glue (a node of the model's own forward that does no FLOPs: shape queries,
  adds, views) joins the unit before it, or the next one at the very start.

A GPT-2-small-sized model gives a dozen units per layer, not thousands.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch.fx

from fxpipe.graphmeta import PATH_KEY

__all__ = ["UnitGroup", "group_units", "join_units", "COMPUTE_OPS", "ROOT_UNIT"]

COMPUTE_OPS = ("call_module", "call_function", "call_method")
ROOT_UNIT = "<root>"  # name of units at the top level of the model


@dataclass(frozen=True)
class UnitGroup:
    """The nodes of one unit and how it connects to the rest of the graph (all by node name)."""

    name: str
    path: str
    kind: str  # "leaf": one leaf-module call (plus its getitems/glue); "ops": a run of functions
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]  # values from outside: placeholders or other units' outputs
    outputs: tuple[str, ...]  # values used outside: by other units or the model output
    get_attrs: tuple[str, ...]  # get_attr nodes (parameters, buffers, constants) it reads
    reads_inputs: tuple[int, ...]  # positions of the model inputs it reads


def _is_indexer(node: torch.fx.Node) -> bool:
    return (
        node.op == "call_function"
        and node.target in (operator.getitem, getattr)
        and isinstance(node.args[0], torch.fx.Node)
        and node.args[0].op in COMPUTE_OPS
    )


def _is_glue(node: torch.fx.Node, flops: dict[str, float]) -> bool:
    return (
        node.meta.get(PATH_KEY, "") == ""
        and node.op != "call_module"
        and flops.get(node.name, 0.0) == 0.0
    )


def group_units(gm: torch.fx.GraphModule, flops: dict[str, float]) -> list[UnitGroup]:
    """Split the compute nodes of ``gm`` into units (see the module docstring for the rules)."""
    runs: list[tuple[tuple[str, str], list[torch.fx.Node]]] = []
    pending: list[torch.fx.Node] = []
    for node in gm.graph.nodes:
        if node.op not in COMPUTE_OPS:
            continue
        if _is_indexer(node) and runs and node.args[0] in runs[-1][1]:
            runs[-1][1].append(node)
            continue
        if _is_glue(node, flops):
            (runs[-1][1] if runs else pending).append(node)
            continue
        path = node.meta.get(PATH_KEY, "")
        key = ("leaf" if node.op == "call_module" else "ops", path)
        if runs and runs[-1][0] == key:
            runs[-1][1].append(node)
        else:
            runs.append((key, pending + [node]))
            pending = []
    if pending:  # a model that is nothing but glue
        runs.append((("ops", ""), pending))
    return _describe(gm, runs)


def join_units(
    gm: torch.fx.GraphModule, groups: list[UnitGroup], together: list[set[str]]
) -> list[UnitGroup]:
    """Merge consecutive units so that the nodes of each set in ``together`` share one unit (a merged
    unit is still a run of consecutive nodes, under the modules' common path)."""
    unit_of = {name: i for i, g in enumerate(groups) for name in g.nodes}
    end = list(range(len(groups)))  # end[i]: last unit merged into the run that starts at i
    for names in together:
        hit = sorted({unit_of[n] for n in names if n in unit_of})
        if len(hit) > 1:
            end[hit[0]] = max(end[hit[0]], hit[-1])
    if end == list(range(len(groups))):
        return groups
    by_name = {n.name: n for n in gm.graph.nodes}
    runs: list[tuple[tuple[str, str], list[torch.fx.Node]]] = []
    i = 0
    while i < len(groups):
        j, reach = (
            i + 1,
            end[i],
        )  # the run grows while the next unit is inside the reach of the run so far
        while j < len(groups) and j <= reach:
            reach = max(reach, end[j])
            j += 1
        members = groups[i:j]
        paths = [g.path.split(".") if g.path else [] for g in members]
        common = paths[0][: min(len(p) for p in paths)]
        while any(p[: len(common)] != common for p in paths):
            common = common[:-1]
        key = (members[0].kind, members[0].path) if len(members) == 1 else ("ops", ".".join(common))
        runs.append((key, [by_name[n] for g in members for n in g.nodes]))
        i = j
    return _describe(gm, runs)


def _describe(
    gm: torch.fx.GraphModule, runs: list[tuple[tuple[str, str], list[torch.fx.Node]]]
) -> list[UnitGroup]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    seen: dict[str, int] = {}
    groups = []
    for (kind, path), nodes in runs:
        base = path or ROOT_UNIT
        count = seen.get(base, 0)
        seen[base] = count + 1
        members = set(nodes)
        inputs: list[torch.fx.Node] = []
        attrs: list[torch.fx.Node] = []
        for node in nodes:
            for arg in node.all_input_nodes:
                if arg in members:
                    continue
                bucket = attrs if arg.op == "get_attr" else inputs
                if arg not in bucket:
                    bucket.append(arg)
        outputs = [n for n in nodes if any(u not in members for u in n.users)]
        groups.append(
            UnitGroup(
                name=base if count == 0 else f"{base}#{count}",
                path=path,
                kind=kind,
                nodes=tuple(n.name for n in nodes),
                inputs=tuple(n.name for n in inputs),
                outputs=tuple(n.name for n in outputs),
                get_attrs=tuple(n.name for n in attrs),
                reads_inputs=tuple(
                    sorted(placeholders.index(n) for n in inputs if n.op == "placeholder")
                ),
            )
        )
    return groups
