"""``fxpipe run`` checks, every step, that the ranks of a pipeline drew the same batch.

Note [one batch per pipeline under fxpipe run]: every rank draws its own batches from the data
function (``fxpipe.runtime.train.data_iter``); the first stage feeds the model the inputs it drew,
the loss stage scores the outputs against the targets it drew. A function that yields other rows
on another rank (seeded from the rank or the process, or from a global RNG that the ranks advance
differently) would train one batch's inputs against another's targets, silently. So before each
step (and each evaluation batch) every rank fingerprints what it drew (Note [batch fingerprint] in
``fxpipe.runtime.pipeline.fingerprint``: inputs and targets apart, each with a digest of their
dtypes, shapes and structure) and the ranks of the pipeline all-gather the fingerprints: 64 bytes
per rank, one collective. Ranks that left the inputs or the targets out (``None``, as
``rank_info.needs_inputs`` / ``needs_targets`` allow) are not compared on them; so a pipeline in
which no two ranks hold the same part has nothing to compare. Replicas draw their own shards and
are not compared with each other. A difference stops every rank of the pipeline with one
``ModelFileError`` naming the step, the part and the ranks.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from fxpipe.errors import ModelFileError
from fxpipe.runtime.pipeline.fingerprint import fingerprint
from fxpipe.runtime.pipeline.p2p import peer_error
from fxpipe.runtime.pipeline.runner import PipelineRunner
from fxpipe.codegen.manifest import Manifest
from fxpipe.runtime.train.data_iter import Placeholders, placeholders

__all__ = ["check_same_batch", "batch_fingerprint", "first_disagreement"]

_PARTS = ("inputs", "targets")


def _part(tree: Any) -> list[int]:
    """[held, digest of the structure, dtypes and shapes, fingerprint a, fingerprint b] of inputs or targets."""
    if tree is None or isinstance(tree, Placeholders):
        return [0, 0, 0, 0]
    leaves, spec = tree_flatten(tree)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    described = repr(
        (
            str(spec),
            [
                (str(x.dtype), tuple(x.shape)) if isinstance(x, torch.Tensor) else repr(x)
                for x in leaves
            ],
        )
    )
    digest = int.from_bytes(
        hashlib.blake2b(described.encode(), digest_size=8).digest(), "little", signed=True
    )
    return [1, digest, *fingerprint(tensors)]


def batch_fingerprint(inputs: Any, targets: Any) -> list[int]:
    """What a rank compares of the batch it drew: its inputs' part, then its targets' part."""
    return _part(inputs) + _part(targets)


def first_disagreement(per_rank: list[list[int]], ranks: list[int]) -> tuple[str, int, int] | None:
    """(part, a rank, another rank whose part differs from it) for the first part that differs, else ``None``.

    >>> first_disagreement([[1, 5, 2, 3, 0, 0, 0, 0], [1, 5, 2, 4, 1, 7, 1, 1]], [0, 1])
    ('inputs', 0, 1)
    >>> first_disagreement([[0, 0, 0, 0, 1, 7, 1, 1], [1, 5, 2, 4, 1, 7, 1, 1]], [0, 1]) is None
    True
    """
    for p, part in enumerate(_PARTS):
        held = [(rank, fp[4 * p : 4 * p + 4]) for rank, fp in zip(ranks, per_rank) if fp[4 * p]]
        for rank, fp in held[1:]:
            if fp != held[0][1]:
                return part, held[0][0], rank
    return None


def _sizes_part(manifest: Manifest, inputs: Any) -> list[int]:
    """The step's dynamic sizes (Note [shape formulas]) as read off the inputs this rank drew; zeros if none."""
    if not manifest.dynamic:
        return []
    if inputs is None or isinstance(inputs, Placeholders):
        return [0] * len(manifest.dynamic)
    sizes = manifest.step_sizes([tuple(t.shape) for t in inputs])
    return [sizes.get(r.name, 0) for r in manifest.dynamic]


def check_same_batch(
    runner: PipelineRunner, inputs: Any, targets: Any, when: str, where: str
) -> Any:
    """Stop every rank of ``runner``'s pipeline if its ranks drew different batches (collective over the
    pipeline). ``when``: "at step 3"; ``where``: the data function's call, for the message.

    Returns the inputs to run: a rank that left them out (``Placeholders``) of a build with dynamic
    dimensions gets placeholders at the step's sizes, which ride on the same all-gather (the ranks that
    drew the batch add them to their fingerprint: no message of its own)."""
    size = runner.manifest.num_ranks
    if size == 1:
        return inputs
    group = runner.groups.pipeline
    device = runner.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    sizes = _sizes_part(runner.manifest, inputs)
    mine = torch.tensor(
        batch_fingerprint(inputs, targets) + sizes, dtype=torch.int64, device=device
    )
    gathered = [torch.empty_like(mine) for _ in range(size)]
    try:
        dist.all_gather(gathered, mine, group=group)
    except RuntimeError as exc:
        raise peer_error(
            exc, runner.rank, "comparing the step's batch across the pipeline", runner.timeout_s
        ) from exc
    ranks = [runner.layout.rank_of(s, runner.replica) for s in range(size)]
    per_rank = [g.tolist() for g in gathered]
    found = first_disagreement(per_rank, ranks)
    if found is not None:
        part, a, b = found
        replica = runner.replica
        raise ModelFileError(
            f"{where} yielded other {part} on rank {b} than on rank {a} {when}, but the ranks of one pipeline "
            f"train on one batch (each reads its part of it); yield the same batches on every rank of replica "
            f"{replica}: seed the data from rank_info.replica ({replica}), not from the rank, the process or the "
            "global random state"
        )
    if sizes and isinstance(inputs, Placeholders):
        drawn = next((fp[8:] for fp in per_rank if fp[0]), None)
        if drawn is not None:
            step = {r.name: v for r, v in zip(runner.manifest.dynamic, drawn)}
            batch = next(
                (
                    t.shape[s.batch_dim]
                    for t, s in zip(inputs, runner.manifest.inputs)
                    if s.batch_dim is not None
                ),
                runner.manifest.batch_size,
            )
            return placeholders(runner.manifest, int(batch), step)
    return inputs
