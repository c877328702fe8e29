"""A run that diverges stops: at its first NaN or infinite loss, saying where, keeping its record and last good checkpoint.

Note [a diverged run stops]: every rank sees the same loss (the last stage broadcasts it over
the pipeline, replicas average it), so every rank decides alike, without a message, to stop
after the step whose loss (or, with clipping, gradient norm; or evaluation loss) is not
finite: the step's update has then already been made from NaN or infinite gradients, and
every later step would train on garbage. The run saves no checkpoint after it (the last
checkpoint is the last good one), rank 0 writes ``run.json`` with ``stopped`` set (the finite
losses, up to the step before), the ranks agree (one barrier, so the record is on disk before
any rank reports) and each raises ``DivergenceError``, which names the step, the stage that
computed the loss, the learning rate and what was kept. Before each checkpoint the ranks also
compare whether their parameters are finite (``non_finite_parameters``), so a checkpoint is
never written from weights that a finite loss has not yet betrayed; that names the stage too.

Under fp16 the loss scaler already skips a step whose gradients overflowed and lowers the
scale (``fxpipe.runtime.pipeline.precision``): such a step's non-finite loss or norm is
recorded as ``None`` and the run goes on.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fxpipe.errors import DivergenceError
from fxpipe.runtime.pipeline.p2p import peer_error

if TYPE_CHECKING:
    from fxpipe.runtime.pipeline.runner import PipelineRunner

__all__ = [
    "finite_or_none",
    "non_finite_step",
    "non_finite_parameters",
    "agree",
    "divergence_error",
]


def finite_or_none(value: float | None) -> float | None:
    """``value`` when it is a finite number, else ``None`` (what ``run.json`` records for it)."""
    return value if value is not None and math.isfinite(value) else None


def non_finite_step(
    step: int, loss: float, grad_norm: float | None, runner: PipelineRunner
) -> str | None:
    """Why step ``step`` diverged (its loss or gradient norm is not finite), or ``None``."""
    last = runner.manifest.num_stages - 1
    if not math.isfinite(loss):
        return f"the loss of step {step} is {loss} (computed on stage {last}, the last)"
    if grad_norm is not None and not math.isfinite(grad_norm):
        return (
            f"the gradient norm of step {step} is {grad_norm} (over every stage, before clipping)"
        )
    return None


def non_finite_parameters(
    runner: PipelineRunner, model: dict[str, torch.Tensor], step: int
) -> str | None:
    """Whether any rank's parameters and buffers (``model``: this rank's, as a checkpoint holds them)
    hold a NaN or infinity after step ``step``; collective over the world, the same answer on every rank."""
    bad = sorted(
        k for k, v in model.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())
    )
    mine = (sorted(runner.stages), bad[:3])
    everyone: list[Any] = [mine]
    if runner.world_size > 1:
        everyone = [None] * runner.world_size
        try:
            dist.all_gather_object(everyone, mine)
        except RuntimeError as exc:
            raise peer_error(
                exc, runner.rank, "checking the parameters before a checkpoint", runner.timeout_s
            ) from exc
    found = next(((stages, keys) for stages, keys in everyone if keys), None)
    if found is None:
        return None
    stages, keys = found
    return (
        f"the parameters of stage {stages[0]} are not finite after step {step} ({', '.join(keys)}), though its "
        "loss was"
    )


def agree(runner: PipelineRunner, doing: str) -> None:
    """Wait until every rank got here (a barrier, collective over the world)."""
    if runner.world_size == 1:
        return
    everyone: list[Any] = [None] * runner.world_size
    try:
        dist.all_gather_object(everyone, runner.rank)
    except RuntimeError as exc:
        raise peer_error(exc, runner.rank, doing, runner.timeout_s) from exc


def divergence_error(
    reason: str, lr: float, saved_after: int | None, checkpoint_dir: str | None, record: str
) -> DivergenceError:
    """The one line a diverged run ends with (the same on every rank)."""
    if checkpoint_dir is None:
        kept = "no checkpoint (no --checkpoint-dir)"
    elif saved_after is None:
        kept = f"no checkpoint: none was saved before it in {checkpoint_dir}"
    else:
        kept = f"the last good checkpoint, after step {saved_after}, in {checkpoint_dir}"
    return DivergenceError(
        f"training diverged: {reason}; stopped there, at lr {lr:.3g}. Kept: {record} (marked "
        f"stopped) and {kept}. Lower --lr, or clip with --clip-grad-norm"
    )
