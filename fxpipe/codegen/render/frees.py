"""Which ``x = None`` frees of a generated ``forward`` lower its peak memory; the rest are left out.

Note [frees that matter]: torch.fx drops every value after its last use (``x = None``). On
a Llama stage that was more than a third of the lines, and most of them change nothing: the
value is a size or a device, or a view whose storage another live value still holds, or an
argument (its caller holds it), or nothing is allocated after it dies. A free lowers a
function's peak only when, without it, the value's storage would still be alive at the
statement where the peak is reached. So the emitter models the peak and keeps the frees it
needs:

- a value holds the tensor storages of its traced value (``aliases.storage_of``: export records
  one per tensor and views share it; without one, a view method holds its input's and anything
  else its own); a storage lives from the statement that makes it until the last value holding
  it is freed (after the statement that frees it) or the function returns; what the arguments
  and parameters hold belongs to the caller;
- a statement needs what is alive while it runs plus, for a call of a generated class, that
  class's own modelled peak beyond what the call returns (bodies are written deepest first, so
  it is known); an operator is counted by what it returns (the workspace a kernel allocates
  and frees inside itself is the same with and without any free);
- sizes are the traced shapes (``TensorSpec``): at the traced microbatch, and per sample (the
  part that scales with the batch). Frees are tried one at a time, the smallest value first,
  and one is left out when, without it, neither peak rises above the peak with every free.

What autograd saves for backward is not modelled: in training, whatever it saves outlives the
function with or without a free. The no-grad forward (inference, and the recompute of
activation checkpointing) is where frees matter, and what this keeps as it was. The
measurement is ``benchmarks/stage_frees`` (peak tensor bytes of transformers stages with
FX's frees, with these, and with none).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Mapping

import torch
import torch.fx as fx

from fxpipe.codegen.graph.aliases import VIEW_METHODS, is_identity_conversion, storage_of
from fxpipe.graphmeta import SPEC_KEY
from fxpipe.tracer.profile import TensorSpec

__all__ = ["Bytes", "FreePlan", "plan_frees"]

Bytes = tuple[int, int]  # (bytes at the traced microbatch, bytes per sample)
_ZERO: Bytes = (0, 0)
RULE = "needed"  # "all" (torch.fx's: every free) and "none" exist for benchmarks/stage_frees to compare with


@dataclass(frozen=True)
class FreePlan:
    """The frees to write (``value -> position`` of the statement after which it is freed) and the modelled
    peak of the function with them."""

    kept: Mapping[fx.Node, int]
    peak: Bytes


def _listed(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _bytes(spec: Any) -> Bytes:
    if not isinstance(spec, TensorSpec):
        return _ZERO
    total = spec.nbytes
    if spec.batch_dim is None or not spec.shape or spec.shape[spec.batch_dim] == 0:
        return total, 0
    return total, total // spec.shape[spec.batch_dim]


def _is_view(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in VIEW_METHODS or is_identity_conversion(node)
    if (
        node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(node.args[0], fx.Node)
        and not isinstance(node.args[0].meta.get("val"), (tuple, list))
    ):
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        return all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in index)
    return False


class _Storages:
    """The storages each value of a graph holds, their sizes, and which belong to the caller."""

    def __init__(self, graph: fx.Graph) -> None:
        self.held: dict[fx.Node, tuple[Hashable, ...]] = {}
        self.size: dict[Hashable, Bytes] = {}
        self.external: set[Hashable] = set()
        for node in graph.nodes:
            keys = self._held(node)
            self.held[node] = keys
            specs = _listed(node.meta.get(SPEC_KEY))
            for i, key in enumerate(keys):
                if key not in self.size:
                    self.size[key] = (
                        _bytes(specs[i]) if len(specs) == len(keys) else _bytes(specs[0])
                    )
                    if node.op in ("placeholder", "get_attr"):
                        self.external.add(key)

    def _held(self, node: fx.Node) -> tuple[Hashable, ...]:
        vals = _listed(node.meta.get("val"))
        tensors = [v for v in vals if isinstance(v, torch.Tensor)]
        keys = [storage_of(v) for v in tensors]
        if tensors and all(k is not None for k in keys):
            return tuple(dict.fromkeys(keys))
        if _is_view(node):  # no traced value to tell: a view holds what its input holds
            return self.held.get(node.args[0], ())  # type: ignore[arg-type]
        if (
            node.op == "call_function"
            and node.target is operator.getitem
            and isinstance(node.args[0], fx.Node)
            and isinstance(node.args[1], int)
        ):
            return ((node.args[0], node.args[1]),)
        specs = _listed(node.meta.get(SPEC_KEY))
        return tuple((node, i) for i, s in enumerate(specs) if isinstance(s, TensorSpec))


def plan_frees(
    graph: fx.Graph,
    statements: list[fx.Node],
    position: Mapping[fx.Node, int],
    candidates: Mapping[fx.Node, int],
    released: Callable[[fx.Node], int],
    workspace: Callable[[fx.Node], Bytes | None] | None = None,
) -> FreePlan:
    """The frees among ``candidates`` (value -> position of the statement after which it would be freed) that
    the modelled peak needs (Note [frees that matter]).

    ``statements``: the nodes written as lines, in order; ``position``: the line that assigns each value (an
    unpacked tuple's items: their tuple's); ``released(node)``: the line after which a value is let go
    without a free (its own for a value no name holds, the line that takes its name again, or
    ``len(statements)``: the return); ``workspace(node)``: the modelled peak of a statement that is a call
    of a generated class, or None.
    """
    storages = _Storages(graph)
    end = len(statements)
    made: dict[Hashable, int] = {}
    holders: dict[Hashable, list[fx.Node]] = {}
    for node in graph.nodes:
        for key in storages.held[node]:
            if key in storages.external or node not in position:
                continue
            holders.setdefault(key, []).append(node)
            made[key] = min(made.get(key, end), position[node])
    natural = {v: released(v) for hs in holders.values() for v in hs}
    stop = {v: min(candidates.get(v, end), natural[v]) for v in natural}
    extra: list[Bytes] = []
    for node in statements:
        need = workspace(node) if workspace is not None else None
        out = _sum(
            storages.size.get(k, _ZERO) for k in storages.held[node] if k not in storages.external
        )
        extra.append(
            _ZERO if need is None else (max(need[0] - out[0], 0), max(need[1] - out[1], 0))
        )
    live = [[0, 0] for _ in range(end)]
    for key, start in made.items():
        size = storages.size.get(key, _ZERO)
        for s in range(start, min(max(stop[v] for v in holders[key]), end - 1) + 1):
            live[s][0] += size[0]
            live[s][1] += size[1]
    best = (
        max((live[s][0] + extra[s][0] for s in range(end)), default=0),
        max((live[s][1] + extra[s][1] for s in range(end)), default=0),
    )
    kept = dict(candidates)
    if RULE != "needed":
        return FreePlan(kept if RULE == "all" else {}, best)

    def owned(value: fx.Node) -> list[Hashable]:
        return [k for k in storages.held.get(value, ()) if k in made]

    order = sorted(
        kept, key=lambda v: (_sum(storages.size.get(k, _ZERO) for k in owned(v)), -kept[v])
    )
    for value in order:
        if value not in stop or natural[value] <= kept[value]:
            del kept[value]  # it holds nothing of this function's, or is let go there anyway
            continue
        grow: dict[int, list[int]] = {}
        for key in owned(value):
            old = max(stop[v] for v in holders[key])
            size = storages.size.get(key, _ZERO)
            for s in range(old + 1, min(natural[value], end - 1) + 1):
                g = grow.setdefault(s, [0, 0])
                g[0] += size[0]
                g[1] += size[1]
        if all(
            live[s][0] + extra[s][0] + g[0] <= best[0]
            and live[s][1] + extra[s][1] + g[1] <= best[1]
            for s, g in grow.items()
        ):
            del kept[value]
            stop[value] = natural[value]
            for s, g in grow.items():
                live[s][0] += g[0]
                live[s][1] += g[1]
    return FreePlan(kept, best)


def _sum(items: Iterable[Bytes]) -> Bytes:
    a = b = 0
    for x, y in items:
        a += x
        b += y
    return a, b
