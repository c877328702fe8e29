"""Split backward: ``B`` computes a stage's input gradients now, ``W`` its weight gradients later.

Note [split backward through the saved graph]: both halves run autograd's own engine on
the graph the forward recorded (no recomputation, no second forward):

1. Walk the graph from the roots (the stage outputs, or the loss) once and mark the
   nodes that lead to a stage input ("the input path"). An input-path node with an edge
   leaving the input path towards a parameter (a matmul's weight branch, a bias) is a
   *boundary node*: its incoming gradient is all ``W`` needs to continue.
2. ``B``: ``torch.autograd.grad(roots, inputs, retain_graph=True)`` runs only the input
   path; a pre-hook on each boundary node keeps the gradient that arrives there.
3. ``W``: the boundary nodes are grouped by the parameters they reach (groups that share
   a parameter, such as a weight tied inside the stage, merge); per group, one
   ``torch.autograd.grad`` from the boundary edges (``GradientEdge``) with the kept
   gradients to the group's parameters. The engine runs only what leads to those
   parameters, so each boundary node computes just its weight branch, and the input
   path is not run again. Roots that do not depend on any input (a first stage fed by
   token ids) are backpropagated to the parameters whole in ``W``. When one boundary node
   of a group lies upstream of another, the engine would also reach the downstream one
   through the input path: a pre-hook then replaces what arrives there by the kept
   gradient, so nothing is counted twice. The gradients are added to ``.grad`` by the
   parameters' own ``AccumulateGrad`` nodes (``torch.autograd.backward(..., inputs=)``).

Each parameter's gradient is the same sum of the same products as the fused backward,
so the split and fused paths give equal gradients (tests/runtime/test_split_backward.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightWork", "backward_inputs", "backward_weights"]


@dataclass
class _Group:
    """One ``W`` call: where it starts (edges or whole roots), with which gradients, and its parameters."""

    starts: list[Node] = field(default_factory=list)
    roots: list[int] = field(default_factory=list)   # indices into WeightWork.roots
    params: list[int] = field(default_factory=list)  # indices into WeightWork.params


@dataclass
class WeightWork:
    """What ``B`` leaves for ``W``: the saved graph's boundary gradients and the parameter groups."""

    roots: list[torch.Tensor]
    root_grads: list[torch.Tensor]
    params: list[torch.Tensor]
    kept: dict[Node, tuple[torch.Tensor | None, ...]]
    groups: list[_Group]


def _node(t: torch.Tensor) -> Node:
    return get_gradient_edge(t).node


def _reach(roots: Sequence[Node], inputs: set[Node], params: dict[Node, int]
           ) -> tuple[dict[Node, bool], dict[Node, list[Node]]]:
    """Whether each node reachable from ``roots`` leads to an input, and its children."""
    leads: dict[Node, bool] = {}
    children: dict[Node, list[Node]] = {}
    stack: list[tuple[Node, bool]] = [(n, False) for n in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            leads[node] = node in inputs or any(leads[c] for c in children[node])
            continue
        if node in children:
            continue
        kids = [c for c, _ in node.next_functions if c is not None]
        children[node] = kids
        stack.append((node, True))
        stack.extend((c, False) for c in kids if c not in children)
    return leads, children


def _params_reached(start: Node, leads: dict[Node, bool], children: dict[Node, list[Node]],
                    params: dict[Node, int]) -> set[int]:
    """Parameters reachable from ``start`` without passing through the input path."""
    found: set[int] = set()
    seen: set[Node] = set()
    stack = [c for c in children.get(start, ()) if not leads.get(c, False)] if leads.get(start, False) else [start]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in params:
            found.add(params[node])
        stack.extend(c for c in children.get(node, ()) if not leads.get(c, False))
    return found


def _groups(starts: list[Node], whole_roots: list[int], reached: list[set[int]]) -> list[_Group]:
    """Merge the starts (boundary nodes, then whole roots) that share a parameter into groups."""
    parent = list(range(len(reached)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    for i, ps in enumerate(reached):
        for p in ps:
            if p in owner:
                parent[find(i)] = find(owner[p])
            else:
                owner[p] = i
    groups: dict[int, _Group] = {}
    for i, ps in enumerate(reached):
        if not ps:
            continue
        g = groups.setdefault(find(i), _Group())
        if i < len(starts):
            g.starts.append(starts[i])
        else:
            g.roots.append(whole_roots[i - len(starts)])
        g.params.extend(p for p in ps if p not in g.params)
    return list(groups.values())


def backward_inputs(roots: Sequence[torch.Tensor], root_grads: Sequence[torch.Tensor],
                    inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                    ) -> tuple[list[torch.Tensor | None], WeightWork]:
    """``B``: the gradients of ``inputs`` (None where unused) and what ``W`` needs later
    (Note [split backward through the saved graph])."""
    root_nodes = [_node(r) for r in roots]
    input_nodes = {_node(x) for x in inputs}
    param_nodes = {_node(p): i for i, p in enumerate(params)}
    leads, children = _reach(root_nodes, input_nodes, param_nodes)
    starts = [n for n, kids in children.items()
              if leads[n] and n not in input_nodes and any(not leads[c] for c in kids)]
    whole = [i for i, n in enumerate(root_nodes) if not leads[n]]
    reached = [_params_reached(n, leads, children, param_nodes) for n in starts]
    reached += [_params_reached(root_nodes[i], leads, children, param_nodes) for i in whole]
    groups = _groups(starts, whole, reached)
    kept: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    wanted = {n for g in groups for n in g.starts}

    def keeper(node: Node):  # noqa: ANN202 - a hook factory
        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            kept[node] = tuple(grad_outputs)
        return hook

    grads: list[torch.Tensor | None] = [None] * len(inputs)
    live = [i for i, n in enumerate(root_nodes) if leads[n]]
    if inputs and live:
        handles = [n.register_prehook(keeper(n)) for n in wanted]
        try:
            got = torch.autograd.grad([roots[i] for i in live], list(inputs), [root_grads[i] for i in live],
                                      retain_graph=True, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        grads = list(got)
    work = WeightWork(roots=list(roots), root_grads=list(root_grads), params=list(params), kept=kept, groups=groups)
    return grads, work


def backward_weights(work: WeightWork) -> None:
    """``W``: add the parameters' gradients to their ``.grad`` (Note [split backward through the saved graph])."""
    for group in work.groups:
        outputs: list[torch.Tensor | GradientEdge] = []
        grads: list[torch.Tensor] = []
        for node in group.starts:
            for slot, g in enumerate(work.kept.get(node, ())):
                if g is not None:
                    outputs.append(GradientEdge(node, slot))
                    grads.append(g)
        for i in group.roots:
            outputs.append(work.roots[i])
            grads.append(work.root_grads[i])
        if not outputs:
            continue
        params = [work.params[i] for i in group.params]
        clamps = []
        if len(group.starts) > 1:   # a kept gradient is the whole gradient: nothing may add to it
            for node in group.starts:
                saved = work.kept.get(node)
                if saved is not None:
                    clamps.append(node.register_prehook(lambda _, saved=saved: saved))
        try:  # accumulates into .grad through the parameters' own AccumulateGrad nodes, as the fused backward
            torch.autograd.backward(outputs, grads, retain_graph=True, inputs=params)
        finally:
            for h in clamps:
                h.remove()
    work.kept.clear()
    work.roots.clear()
    work.root_grads.clear()
