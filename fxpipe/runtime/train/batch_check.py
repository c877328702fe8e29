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
``ModelFileError`` naming the step, the tensor, the ranks and how to seed the data. The
comparison is ``PipelineRunner``'s (Note [one batch per pipeline] in
``fxpipe.runtime.pipeline.batch_agreement``); the loop turns the runner's own check off and
calls this one, whose line names the data function.
"""

from __future__ import annotations

from typing import Any

from fxpipe.errors import ModelFileError
from fxpipe.runtime.pipeline import batch_agreement
from fxpipe.runtime.pipeline.batch_agreement import (
    first_disagreement,
    gather_fingerprints,
    name_disagreement,
)
from fxpipe.runtime.pipeline.runner import PipelineRunner
from fxpipe.codegen.manifest import Manifest
from fxpipe.runtime.train.data_iter import Placeholders, placeholders

__all__ = ["check_same_batch", "batch_fingerprint", "first_disagreement"]


def _held(part: Any) -> Any:
    """``part``, or None for what this rank did not yield (not compared)."""
    return None if isinstance(part, Placeholders) else part


def batch_fingerprint(inputs: Any, targets: Any) -> list[int]:
    """What a rank compares of the batch it drew (``Placeholders``: not drawn, not compared)."""
    return batch_agreement.batch_fingerprint(_held(inputs), _held(targets))


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
    ranks = runner.pipeline_ranks()
    if len(ranks) == 1:
        return inputs
    sizes = _sizes_part(runner.manifest, inputs)
    per_rank = gather_fingerprints(
        _held(inputs),
        _held(targets),
        group=runner.groups.pipeline,
        ranks=ranks,
        device=runner.device,
        rank=runner.rank,
        timeout_s=runner.timeout_s,
        extra=sizes,
    )
    found = name_disagreement(
        per_rank,
        _held(inputs),
        _held(targets),
        runner.groups.pipeline,
        ranks,
        runner.rank,
        runner.timeout_s,
    )
    if found is not None:
        replica = runner.replica
        raise ModelFileError(
            f"{where} yielded other {found.part} on rank {found.other} than on rank {found.first} "
            f"{when} ({found.tensor} differs), but the ranks of one pipeline train on one batch (each "
            f"reads its part of it); yield the same batches on every rank of replica {replica}: seed "
            f"the data from rank_info.replica ({replica}), not from the rank, the process or the "
            "global random state (e.g. torch.Generator().manual_seed(seed + rank_info.replica) for "
            "a DataLoader's generator)"
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
