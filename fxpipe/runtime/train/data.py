"""The data a worker trains on: the model file's example batch, and each replica's rows of it.

With R data-parallel replicas of batch ``B`` each, every rank builds
``example_inputs(B*R)`` / ``example_targets(B*R)`` and keeps replica r's rows
``[r*B, (r+1)*B)`` along each tensor's batch dim, so the replicas together see the batch
that one process training on ``B*R`` samples would. A model file without ``loss_fn``
trains on the model's own loss (``fxpipe.runtime.pipeline.loss``) and needs no targets.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from fxpipe.codegen.integrity import check_build
from fxpipe.codegen.manifest import Manifest
from fxpipe.errors import ModelFileError
from fxpipe.modelfile import ModelSource

__all__ = ["model_source", "example_batch", "replica_batch", "target_batch_dims"]


def model_source(build_dir: Path, manifest: Manifest) -> ModelSource:
    """The build's model file, which must define the targets to train on when it defines a loss function."""
    if not manifest.model_file:
        raise ModelFileError(
            f"{build_dir}/manifest.json names no model file, so there is no data to train on"
        )
    # checked against the manifest, then imported from the checked bytes (Note [check before use])
    source = check_build(build_dir, [], plan=False, weights=False, manifest=manifest).model_source()
    if source.has_loss_fn and not source.has(source.targets_fn):
        raise ModelFileError(
            f"{source.path.name} defines {source.loss_fn_name}() but no "
            f"{source.targets_fn}(batch_size); `fxpipe run` needs targets for it (or drop "
            f"{source.loss_fn_name}() to train on the loss the model computes itself)"
        )
    return source


def example_batch(
    source: ModelSource, manifest: Manifest, batch_size: int
) -> tuple[tuple[torch.Tensor, ...], Any]:
    """The build's tensor inputs (the model file's example call bound to the build, Note [the traced
    call] in ``fxpipe.tracer.call``) and targets (``None`` without a loss function) for ``batch_size`` samples."""
    inputs = manifest.call_spec.bind_any(source.example_call(batch_size))
    return inputs, source.example_targets(batch_size) if source.has_loss_fn else None


def replica_batch(
    inputs: tuple[torch.Tensor, ...],
    targets: Any,
    batch_dims: Sequence[int | None],
    replica: int,
    batch_size: int,
    target_dims: Sequence[int | None] | None = None,
) -> tuple[tuple[torch.Tensor, ...], Any]:
    """Rows ``[replica*batch_size, (replica+1)*batch_size)`` of a batch made for all replicas.

    Inputs are cut along their batch dim (``None``: shared, passed whole); the leaves of the
    (nested) targets along ``target_dims`` (default: dim 0), as ``split_targets`` does.

    >>> x, y = replica_batch((torch.arange(6).view(6, 1),), torch.arange(6), [0], 1, 2)
    >>> x[0].flatten().tolist(), y.tolist()
    ([2, 3], [2, 3])
    """
    start = replica * batch_size

    def cut(t: Any, dim: int | None) -> Any:
        if dim is None or not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        if t.shape[dim] < start + batch_size:
            raise ModelFileError(
                f"example data has {t.shape[dim]} rows along dim {dim}, but replica {replica} "
                f"needs rows [{start}, {start + batch_size}); example_inputs(n) and "
                "example_targets(n) must return n rows"
            )
        return t.narrow(dim, start, batch_size)

    leaves, spec = tree_flatten(targets)
    dims = [0] * len(leaves) if target_dims is None else target_dims
    return (
        tuple(cut(t, d) for t, d in zip(inputs, batch_dims)),
        tree_unflatten([cut(x, d) for x, d in zip(leaves, dims)], spec),
    )


def target_batch_dims(source: ModelSource, batch_size: int) -> tuple[int | None, ...]:
    """The batch dim of each leaf of the model file's targets, from ``example_targets`` at
    ``batch_size`` and twice that (a leaf that does not grow is shared)."""
    from fxpipe.tracer.measure.shapes import infer_batch_dims

    first, second = (
        tree_leaves(source.example_targets(batch_size)),
        tree_leaves(source.example_targets(2 * batch_size)),
    )
    tensors = [i for i, x in enumerate(first) if isinstance(x, torch.Tensor)]
    if len(first) != len(second) or any(not isinstance(second[i], torch.Tensor) for i in tensors):
        raise ModelFileError(
            f"{source.path.name}:{source.targets_fn}(n) returns differently structured targets "
            f"for n={batch_size} and n={2 * batch_size}"
        )
    try:
        found = infer_batch_dims([first[i] for i in tensors], [second[i] for i in tensors])
    except ValueError as exc:
        raise ModelFileError(
            f"{source.path.name}:{source.targets_fn}(n): {exc}".replace("input", "target")
        ) from None
    dims: list[int | None] = [None] * len(first)
    for i, d in zip(tensors, found):
        dims[i] = d
    return tuple(dims)
