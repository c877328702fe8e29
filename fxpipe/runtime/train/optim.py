"""Optimizers and learning-rate schedules of ``fxpipe run``, made from ``TrainingOptions`` with torch's own classes.

Each rank builds its optimizer over its own stage's parameters (``optimizer_factory``)
and a ``torch.optim.lr_scheduler.LambdaLR`` over it (``scheduler_factory``) whose factor
is ``lr_factor``: the same factor on every rank, and the same as one process training the
whole model with these factories (what the tests compare against).

>>> [round(lr_factor(s, warmup_steps=2, total_steps=6, schedule="linear"), 3) for s in range(6)]
[0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from fxpipe.runtime.train.training_options import TrainingOptions

__all__ = ["lr_factor", "optimizer_factory", "scheduler_factory", "SchedulerFactory"]

SchedulerFactory = Callable[[torch.optim.Optimizer], LRScheduler]


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """The multiple of the peak learning rate used by optimizer step ``step`` (0-based).

    Warm-up: ``(step + 1) / warmup_steps`` for the first ``warmup_steps`` steps (the first
    step already moves). Then ``constant`` 1; ``linear`` from 1 down towards 0 at
    ``total_steps``; ``cosine`` half a cosine from 1 towards 0 at ``total_steps``. A resume with
    a larger ``--steps`` stretches the decay to the new total, and says so (Note [what a resume
    carries over] in ``fxpipe.runtime.train.resume``).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
    progress = min(max(progress, 0.0), 1.0)
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown learning-rate schedule {schedule!r}")


def optimizer_factory(
    options: TrainingOptions, lr: float
) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    """``params -> torch.optim.SGD / Adam / AdamW`` with ``lr`` and the options' weight decay and betas."""

    def make(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        params = list(params)
        if options.optimizer == "sgd":
            return torch.optim.SGD(params, lr=lr, weight_decay=options.weight_decay)
        cls = torch.optim.AdamW if options.optimizer == "adamw" else torch.optim.Adam
        return cls(params, lr=lr, betas=options.betas, weight_decay=options.weight_decay)

    return make


def scheduler_factory(options: TrainingOptions, total_steps: int) -> SchedulerFactory:
    """``optimizer -> LambdaLR`` following ``lr_factor`` over ``total_steps`` optimizer steps."""

    def make(optimizer: torch.optim.Optimizer) -> LRScheduler:
        return LambdaLR(
            optimizer,
            lambda step: lr_factor(
                step,
                warmup_steps=options.warmup_steps,
                total_steps=total_steps,
                schedule=options.lr_schedule,
            ),
        )

    return make
