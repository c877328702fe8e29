"""Gradient clipping across a pipeline: the global norm of the whole model's gradient, from its stages.

Each rank holds a few stages' gradients. The norm ``torch.nn.utils.clip_grad_norm_``
would compute on the one-process model is the p-norm of all of them together, so each
rank sums ``|g|^p`` over its own parameters and the ranks of one pipeline add their sums
(one ``all_reduce`` over the pipeline's group; ``max`` for the inf-norm). A tied
parameter has a copy on several stages, each holding the same summed gradient
(``fxpipe.runtime.pipeline.ties``) after backward; only the copy on the tie's first stage counts,
as the original model holds it once. Data-parallel replicas hold equal gradients after
DDP's all-reduce, so each replica computes the same norm over its own pipeline and
scales identically. Every gradient is then scaled by ``min(1, max_norm / (norm + 1e-6))``,
as torch does.

Note [norm of tensor-parallel gradients]: with tensor parallelism (``tp_group``) a split
parameter's gradient is a DTensor sharded over the tp group: each tp rank holds one shard, so
their ``|g|^p`` are first added over the tp group (each shard counted once), then the
pipeline's ranks (of one tp index) add their sums. A replicated parameter (plain, or a DTensor
with replicated placements, as a row-parallel bias) has the same gradient on every tp rank and
is counted once, from its own rank's copy. So every rank gets the one-process norm.
With FSDP over the replicas of a tensor-parallel stage (Note [FSDP over TP] in
``fxpipe.runtime.dataparallel.sharded``) a gradient is a DTensor on the stage's ``(dp, tp)``
mesh, or on its ``dp`` dim alone (a parameter tp replicates): the shards' ``|g|^p`` are added
over each mesh dim the gradient is split on (``dp``, ``tp`` or both, by the dims' names; one
all-reduce per such set of dims, in the same order on every rank of the stage), and a dim it is
replicated on counts once.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fxpipe.codegen.manifest import Manifest
from fxpipe.errors import ConfigError
from fxpipe.runtime.local_shard import local_tensor
from fxpipe.runtime.pipeline.p2p import peer_error

__all__ = ["counted_parameters", "pipeline_grad_norm", "clip_grads_"]


def counted_parameters(manifest: Manifest, stages: Mapping[int, nn.Module]) -> list[nn.Parameter]:
    """This rank's parameters, each once, without the tied copies whose tie's first stage is elsewhere."""
    by_stage = {s: dict(m.named_parameters(remove_duplicate=False)) for s, m in stages.items()}
    owned: set[int] = set()
    skip: set[int] = set()
    for tie in manifest.ties:
        for i, (stage, key) in enumerate(zip(tie.stages, tie.keys)):
            p = by_stage.get(stage, {}).get(key)
            if p is not None:
                (owned if i == 0 else skip).add(id(p))
    seen: set[int] = set()
    out = []
    for s in sorted(stages):
        for p in stages[s].parameters():
            if id(p) in seen or (id(p) in skip and id(p) not in owned):
                continue
            seen.add(id(p))
            out.append(p)
    return out


def _is_split(g: torch.Tensor) -> bool:
    """Whether ``g`` is a DTensor sharded over its mesh (not only replicated)."""
    return isinstance(g, DTensor) and not all(p.is_replicate() for p in g.placements)


def _split_dims(g: DTensor) -> tuple[str, ...]:
    """The names of the mesh dims ``g`` is sharded over (``Shard``, FSDP's ``_StridedShard``)."""
    names = g.device_mesh.mesh_dim_names
    assert names is not None, "the stage's (dp, tp) mesh names its dims"
    return tuple(names[i] for i, p in enumerate(g.placements) if not p.is_replicate())


def _shard_sums(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """``sum |g|^p`` (``max``: inf-norm) of split gradients over the ranks holding their shards:
    grouped by the named mesh dims each is split over, each group reduced over those dims."""
    by_dims: dict[tuple[str, ...], list[DTensor]] = {}
    for g in grads:
        assert isinstance(g, DTensor)
        by_dims.setdefault(_split_dims(g), []).append(g)
    inf = norm_type == float("inf")
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    total = torch.zeros((), device=device)
    for dims in sorted(by_dims):  # the same order on every rank of the stage
        group = by_dims[dims]
        part = _combine([local_tensor(g) for g in group], norm_type, device)
        for dim in dims:
            dist.all_reduce(part, op=op, group=group[0].device_mesh.get_group(dim))
        total = torch.maximum(total, part) if inf else total + part
    return total


def _combine(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """``max |g|`` (inf-norm) or ``sum |g|^p`` over ``grads`` (local tensors)."""
    norms = [torch.linalg.vector_norm(g.detach(), norm_type).float().to(device) for g in grads]
    if not norms:
        return torch.zeros((), device=device)
    if norm_type == float("inf"):
        return torch.stack(norms).max()
    return (torch.stack(norms) ** norm_type).sum()


def pipeline_grad_norm(
    params: list[nn.Parameter],
    norm_type: float,
    group: dist.ProcessGroup | None,
    device: torch.device,
    rank: int = 0,
    timeout_s: float = 0.0,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The ``norm_type``-norm of the gradients of ``params`` on every rank of ``group`` together
    (collective); with ``tp_group`` the split gradients' shards count once each (Note [norm of
    tensor-parallel gradients])."""
    grads = [p.grad for p in params if p.grad is not None]
    split = [local_tensor(g) for g in grads if _is_split(g)]
    if split and tp_group is None:
        raise ConfigError(
            "gradient clipping across the pipeline does not support sharded stages (--shard grad-op or "
            "full) yet; clip without --shard, or leave --clip-grad-norm out"
        )
    inf = norm_type == float("inf")
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    local = _combine([local_tensor(g) for g in grads if not _is_split(g)], norm_type, device)
    try:
        if tp_group is not None:  # each shard once: Note [norm of tensor-parallel gradients]
            shards = _shard_sums([g for g in grads if _is_split(g)], norm_type, device)
            local = torch.maximum(local, shards) if inf else local + shards
        dist.all_reduce(local, op=op, group=group)
    except RuntimeError as exc:
        raise peer_error(
            exc, rank, "adding up the gradient norm over the pipeline", timeout_s
        ) from exc
    return local if inf else local ** (1.0 / norm_type)


def clip_grads_(params: list[nn.Parameter], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale the gradients of ``params`` by ``min(1, max_norm / (total_norm + 1e-6))`` (torch's rule)."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:  # a DTensor's local shard: every rank scales its own
            g = local_tensor(p.grad)
            g.detach().mul_(coef.to(g.device, g.dtype))
