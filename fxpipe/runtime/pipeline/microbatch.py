"""Microbatching: cut a batch into M equal microbatches along each tensor's batch dim.

The last microbatch is never uneven: a batch that M does not divide is refused with the
sizes that would work. Equal microbatches keep every receive buffer one shape (taken
from the manifest, no handshake) and make "average over microbatches" equal the
full-batch mean of a mean-reduced loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.errors import ConfigError

__all__ = ["check_divisible", "split_inputs", "split_targets"]


CLI_SETTING = "--microbatches"  # how the microbatch count is set, named in messages (the seed API names its key)


def check_divisible(batch_size: int, microbatches: int, setting: str = CLI_SETTING) -> int:
    """The microbatch size ``batch_size // microbatches``; refuses an uneven split, naming the ``setting`` that
    chose the count (``--microbatches``; the seed API: its config key)."""
    if microbatches < 1:
        raise ConfigError(f"microbatches must be >= 1, got {microbatches}")
    if batch_size % microbatches:
        ok = [m for m in range(1, batch_size + 1) if batch_size % m == 0]
        raise ConfigError(
            f"batch size {batch_size} does not split into {microbatches} equal microbatches "
            f"(fxpipe refuses an uneven last microbatch); set {setting} to one of {ok}, or use a batch size "
            f"that is a multiple of {microbatches}"
        )
    return batch_size // microbatches


def _split(t: torch.Tensor, dim: int | None, microbatches: int, setting: str) -> list[torch.Tensor]:
    if dim is None:
        return [t] * microbatches
    check_divisible(t.shape[dim], microbatches, setting)
    return list(torch.chunk(t, microbatches, dim=dim))


def split_inputs(
    inputs: Sequence[torch.Tensor],
    batch_dims: Sequence[int | None],
    microbatches: int,
    setting: str = CLI_SETTING,
) -> list[tuple[torch.Tensor, ...]]:
    """Per microbatch, the model inputs (a tensor with batch dim ``None`` is shared)."""
    if len(inputs) != len(batch_dims):
        raise ConfigError(f"got {len(inputs)} model inputs but the build expects {len(batch_dims)}")
    columns = [_split(t, d, microbatches, setting) for t, d in zip(inputs, batch_dims)]
    return [tuple(col[m] for col in columns) for m in range(microbatches)]


def split_targets(
    targets: Any,
    microbatches: int,
    batch_dims: Sequence[int | None] | None = None,
    setting: str = CLI_SETTING,
) -> list[Any]:
    """Per microbatch, the targets. ``batch_dims[i]`` is the batch dim of the i-th leaf of
    the (nested) targets, ``None`` for a leaf every microbatch shares; without it every
    tensor leaf is cut along dim 0."""
    leaves, spec = tree_flatten(targets)
    if batch_dims is None:
        batch_dims = [0 if isinstance(x, torch.Tensor) and x.dim() > 0 else None for x in leaves]
    if len(batch_dims) != len(leaves):
        raise ConfigError(
            f"target_batch_dims lists {len(batch_dims)} dims but the targets have {len(leaves)} leaves"
        )
    columns = [
        _split(x, d, microbatches, setting) if d is not None else [x] * microbatches
        for x, d in zip(leaves, batch_dims)
    ]
    return [tree_unflatten([col[m] for col in columns], spec) for m in range(microbatches)]
