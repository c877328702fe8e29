"""Tied parameters: after backward, sum each tied parameter's gradient over its stages.

Every copy starts equal (codegen writes the same tensor into each stage's weights) and
receives the same summed gradient, so any optimizer keeps the copies identical, as the
single shared parameter of the original model would be. A frozen tied parameter is frozen in
every stage (Note [frozen parameters] in ``fxpipe.codegen.graph.ownership``): it is skipped everywhere
alike, and gets no gradient (a zero one would give it optimizer state and weight decay).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fxpipe.errors import BuildDirError
from fxpipe.runtime.local_shard import local_tensor
from fxpipe.runtime.pipeline.p2p import peer_error

__all__ = ["settled_grad", "sync_tied_grads"]


def settled_grad(p: torch.Tensor) -> torch.Tensor | None:
    """``p.grad`` laid out as ``p``: a DTensor gradient DTensor left in another placement than its
    parameter's (an embedding split over its vocabulary gets a ``Partial`` one from torch's
    embedding backward) redistributed to it, so its local tensor is the local shard's gradient."""
    g = p.grad
    if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
        return g.redistribute(p.device_mesh, p.placements)
    return g


def sync_tied_grads(
    module: nn.Module, ties: Sequence[tuple[str, dist.ProcessGroup]], rank: int, timeout_s: float
) -> None:
    """All-reduce (sum) the gradient of each tied parameter of ``module`` within its tie group."""
    params = dict(module.named_parameters(remove_duplicate=False))
    for key, group in ties:
        p = params.get(key)
        if p is None:
            raise BuildDirError(
                f"the manifest ties parameter {key!r} to other stages, but this stage has no "
                f"parameter of that name (it has {sorted(params)[:8]}...); rebuild the directory"
            )
        if not p.requires_grad:
            continue  # frozen in the model, so in every stage that holds it: no gradient to sum
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad = settled = settled_grad(p)  # a vocabulary-parallel embedding's comes partial
        assert settled is not None, "it had a gradient"
        grad = local_tensor(settled)  # FSDP: every copy's shard r is alike
        try:
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
        except RuntimeError as exc:
            raise peer_error(
                exc, rank, f"summing the gradient of tied parameter {key!r}", timeout_s
            ) from exc
