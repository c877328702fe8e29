"""Shape propagation: every node's ``TensorSpec``, its batch dimension and forward FLOPs.

The graph runs twice: at the traced batch ``B`` (with autograd on and floating inputs
requiring grad, so ``requires_grad`` is exactly "depends on a parameter or a floating
input"; with ``FlopCounterMode`` to charge FLOPs to each node) and at ``2B`` (inputs
concatenated with themselves). A dimension whose size doubles is the batch dimension.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.utils.flop_counter import FlopCounterMode

from fxpipe.tracer.profile import TensorSpec
from fxpipe.tracer.traced import SPEC_KEY

__all__ = ["Propagation", "propagate", "double_batch", "dtype_name", "requiring_grad"]


@dataclass(frozen=True)
class Propagation:
    """Values of one run at the traced batch, keyed by node, and forward FLOPs per node name."""

    values: dict[torch.fx.Node, Any]
    flops: dict[str, float]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def double_batch(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The same samples twice: each input concatenated with itself along dim 0."""
    return tuple(torch.cat([t, t]) if t.dim() > 0 else t for t in inputs)


def requiring_grad(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Detached copies of the inputs; floating ones require grad."""
    return tuple(t.detach().requires_grad_(t.is_floating_point()) for t in inputs)


class _Counting(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, counter: FlopCounterMode | None) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.counter = counter
        self.flops: dict[str, float] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        if self.counter is None:
            return super().run_node(n)
        before = self.counter.get_total_flops()
        result = super().run_node(n)
        self.flops[n.name] = float(self.counter.get_total_flops() - before)
        return result


def _spec(value: Any, doubled: Any, batch: int) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorSpec(shape=tuple(value.shape), dtype=dtype_name(value.dtype),
                          batch_dim=_batch_dim(value, doubled, batch), requires_grad=value.requires_grad)
    if isinstance(value, (tuple, list)):
        others = doubled if isinstance(doubled, (tuple, list)) and len(doubled) == len(value) else [None] * len(value)
        return tuple(_spec(v, d, batch) for v, d in zip(value, others))
    return None


def _batch_dim(value: torch.Tensor, doubled: Any, batch: int) -> int | None:
    if isinstance(doubled, torch.Tensor) and doubled.dim() == value.dim():
        for dim, (a, b) in enumerate(zip(value.shape, doubled.shape)):
            if b == 2 * a and a > 0:
                return dim
        return None
    # no second run: assume a leading dimension equal to the batch is the batch
    return 0 if value.dim() > 0 and value.shape[0] == batch else None


def propagate(gm: torch.fx.GraphModule, inputs: tuple[torch.Tensor, ...], batch_size: int) -> Propagation:
    """Run ``gm`` at ``B`` and ``2B`` and set ``node.meta[SPEC_KEY]`` on every node."""
    counting = _Counting(gm, FlopCounterMode(display=False))
    with counting.counter:  # type: ignore[union-attr]
        counting.run(*requiring_grad(inputs))
    doubled: dict[torch.fx.Node, Any] = {}
    try:
        with torch.no_grad():
            second = _Counting(gm, None)
            second.run(*double_batch(inputs))
            doubled = second.env
    except Exception as exc:  # noqa: BLE001 - we can still guess, but say so
        warnings.warn(f"fxpipe: running the graph at batch {2 * batch_size} failed ({type(exc).__name__}: {exc}); "
                      "assuming dimension 0 is the batch dimension wherever its size equals the batch", stacklevel=2)
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        node.meta[SPEC_KEY] = _spec(counting.env[node], doubled.get(node), batch_size)
    return Propagation(values=counting.env, flops=counting.flops)
