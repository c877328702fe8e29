"""In-place calls in a traced graph: which values they change, and what must stay on one stage.

Note [in-place ops across stages]: a traced graph's edges say which values a call reads,
not which it changes. ``h = self.a(x); skip = h; h = self.act(h)`` with
``ReLU(inplace=True)`` gives ``add(c, a)`` for ``c + skip``: the graph reads ``a``, the
program reads ``a`` after ``act`` changed it. One process cannot tell the difference
(one tensor), a pipeline can: every tensor that crosses a stage boundary is a copy
taken when its producer's forward ends, so a stage that reads ``a`` from stage 0 while
stage 1 applies the ReLU to its own copy computes something else.

The tracer finds the in-place calls by running the graph once (:class:`MutationLog`,
inside shape propagation): a call changed a tensor argument when the argument's
version counter moved (views share it with their base, so a write through a view
counts). Then :func:`isolate_mutations` makes the graph and its units say the truth:

- a changed storage whose every value is one tensor object (``x``, ``x.relu_()``, ``x +=
  y``: the common case) is a chain of versions. Every read of a stale name after a
  call changed it is rewired to that call's result (the same object, so the graph
  still runs the same), and the reads of one version (the nodes between two calls
  that read it, and the call that changes it) share a unit. A stage that receives a
  version it changes gets a private copy (``StageGraph.mutated``); the versions after
  travel as the results they are.
- any other changed storage (a write through a view, ``x[i] = y``, a changed model
  input or parameter seen under other names): every node that makes or reads a value
  of that storage, up to the last call that changes it, shares a unit (all of them,
  for a model input or an attribute), so the writes and the reads before them happen
  on one stage in program order and later stages receive the final value.

The run executes every node of the merged graph, each mode's own too (Note [both modes
in one graph]: shape propagation does not honour guards), so an in-place call made in
one mode only is seen as well. Such a call is never rewired to: a changed storage with a
mode-guarded writer is handled the second way.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch
import torch.fx as fx

from fxpipe.graphmeta import GUARD_KEY

__all__ = ["MutationLog", "isolate_mutations", "storage_id"]


def storage_id(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (shared by its views), on real, meta and fake tensors alike. Not
    ``fxpipe.tracer.measure.meta.storage_key``: its data address is 0 for every empty tensor, which would make
    them all one storage here."""
    return t.untyped_storage()._cdata


class MutationLog:
    """The in-place calls seen while an interpreter runs a graph: ``found[node] = names of the changed arguments``.

    Example (inside ``Interpreter.run_node``)::

        return log.run(node, self.env, lambda: super().run_node(node))
    """

    def __init__(self) -> None:
        self.found: dict[str, tuple[str, ...]] = {}

    def run(self, node: fx.Node, env: dict[fx.Node, Any], call: Callable[[], Any]) -> Any:
        """``call()`` (running ``node``), noting which tensor arguments it changed in place."""
        if node.op not in ("call_function", "call_method", "call_module"):
            return call()
        args = [(a, env[a]) for a in node.all_input_nodes if isinstance(env.get(a), torch.Tensor)]
        before = [t._version for _, t in args]
        result = call()
        changed = tuple(a.name for (a, t), v in zip(args, before) if t._version != v)
        if changed:
            self.found[node.name] = changed
        return result


def isolate_mutations(
    gm: fx.GraphModule, values: dict[fx.Node, Any], found: dict[str, tuple[str, ...]]
) -> tuple[list[set[str]], dict[str, tuple[str, ...]]]:
    """Rewire stale reads and say which nodes must share a unit (Note [in-place ops across stages]).

    ``values``: every node's value from the run that filled ``found`` (a :class:`MutationLog`).
    Returns the node-name sets for :func:`fxpipe.tracer.units.join_units` and, per in-place
    call, the names of the arguments it changes after the rewiring.
    """
    if not found:
        return [], {}
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    members: dict[int, list[fx.Node]] = defaultdict(
        list
    )  # storage -> nodes whose value lives there
    for n in nodes:
        v = values.get(n)
        if isinstance(v, torch.Tensor):
            members[storage_id(v)].append(n)
    keys_of = {
        name: {storage_id(values[by_name[a]]) for a in changed} for name, changed in found.items()
    }
    writers: dict[int, list[fx.Node]] = defaultdict(list)
    for name, keys in keys_of.items():
        for key in keys:
            writers[key].append(by_name[name])
    together: list[set[str]] = []
    for key, calls in writers.items():
        calls.sort(key=order.__getitem__)
        if _one_object(members[key], calls, values):
            together += _rewire_versions(members[key], calls, order)
        else:
            together.append(_touching(members[key], calls, order))
    changed_after = {
        name: tuple(
            a.name
            for a in by_name[name].all_input_nodes
            if isinstance(values.get(a), torch.Tensor) and storage_id(values[a]) in keys
        )
        for name, keys in keys_of.items()
    }
    gm.recompile()
    return together, changed_after


def _one_object(members: list[fx.Node], calls: list[fx.Node], values: dict[fx.Node, Any]) -> bool:
    """Whether every value of the storage, every writer's result included, is one tensor object, and every
    writer runs in both modes (``x[i] = y`` returns None: nothing to rewire to)."""
    first = values[members[0]]
    return all(
        values[m] is first and m.op not in ("placeholder", "get_attr") for m in members
    ) and all(values.get(c) is first and GUARD_KEY not in c.meta for c in calls)


def _rewire_versions(
    members: list[fx.Node], calls: list[fx.Node], order: dict[fx.Node, int]
) -> list[set[str]]:
    """A chain of versions of one tensor: stale reads read the latest version (the model's output too);
    each version's readers share a unit with the call that changes it."""
    names = set(members)
    readers = sorted({u for m in members for u in m.users} | set(calls), key=order.__getitem__)
    together: list[set[str]] = []
    latest: fx.Node | None = None
    group: set[str] = set()
    pending = iter(calls)
    nxt = next(pending, None)
    for r in readers:
        if latest is not None:
            stale = [a for a in r.all_input_nodes if a in names and order[a] < order[latest]]
            for a in stale:
                r.replace_input_with(a, latest)
        if r.op == "output":
            continue
        group.add(r.name)
        if r is nxt:
            together.append(group)
            group, latest, nxt = set(), r, next(pending, None)
    return together


def _touching(members: list[fx.Node], calls: list[fx.Node], order: dict[fx.Node, int]) -> set[str]:
    """Every node that makes or reads a value of the storage, up to its last writer (all of them when
    the storage is a model input's or an attribute's, which every stage can read as it was)."""
    whole = any(m.op in ("placeholder", "get_attr") for m in members)
    last = order[calls[-1]]
    nodes = set(members) | {u for m in members for u in m.users if u.op != "output"}
    return {n.name for n in nodes if whole or order[n] <= last}
