"""``StageExecutor``: runs one stage's schedule actions for one training step.

The messages of each action follow from the routes (Note [implied communication] in
``fxpipe.runtime.stage_io``); this module only walks the schedule and computes the
loss on the last stage. The actions run back to back, so the sends of one action are
posted together with the receives of the next (``StageWorker(pair_sends=True)``). With
non-blocking sends a schedule is deadlock-free exactly when ``validate.simulate``
finishes it, which ``PipelineRunner`` checks up front.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from fxpipe.codegen.manifest import Manifest
from fxpipe.errors import RuntimeSetupError
from fxpipe.runtime.p2p import P2P
from fxpipe.runtime.routes import Routes
from fxpipe.runtime.schedule import ActionKind, Schedule
from fxpipe.runtime.stage_io import StageWorker, assemble_output, microbatch_size

__all__ = ["StageExecutor", "assemble_output", "LossFn"]

LossFn = Callable[[Any, Any], torch.Tensor]


class StageExecutor:
    """Executes ``schedule``'s actions for ``stage`` with ``module`` as that stage."""

    def __init__(self, manifest: Manifest, routes: Routes, stage: int, module: nn.Module,
                 schedule: Schedule, p2p: P2P, device: torch.device, average_grads: bool = True) -> None:
        self.manifest = manifest
        self.stage = stage
        self.spec = manifest.stage(stage)
        self.schedule = schedule
        self.actions = schedule.rank_actions(schedule.stage_ranks[stage])
        self.average_grads = average_grads
        self.is_loss_stage = stage == routes.loss_stage
        self.worker = StageWorker(manifest, routes, stage, module, p2p, device, pair_sends=True)
        if any(a.kind is ActionKind.WEIGHT for a in self.actions):
            raise RuntimeSetupError(f"schedule {schedule.name!r} has W (weight-gradient) actions, which this "
                                    "executor does not split from B yet; use 'gpipe' or '1f1b'")

    def run(self, inputs: Sequence[tuple[torch.Tensor, ...]], targets: Sequence[Any] | None,
            loss_fn: LossFn | None) -> list[torch.Tensor]:
        """Run this stage's actions on the microbatches; return the per-microbatch losses
        (detached) on the last stage and ``[]`` elsewhere. Gradients accumulate in ``.grad``."""
        M = len(inputs)
        if M != self.schedule.num_microbatches:
            raise RuntimeSetupError(f"got {M} microbatches but the schedule was made for "
                                    f"{self.schedule.num_microbatches}")
        if self.is_loss_stage and loss_fn is None:
            raise RuntimeSetupError("the last stage needs a loss_fn to train")
        mb_size = microbatch_size(self.manifest, inputs[0])
        scale = 1.0 / M if self.average_grads else 1.0
        live: dict[int, torch.Tensor] = {}   # losses between their microbatch's F and B
        losses: list[torch.Tensor] = [torch.zeros(())] * M
        for action in self.actions:
            m = action.microbatch
            if action.kind is ActionKind.FORWARD:
                outputs = self.worker.forward(m, inputs[m], mb_size)
                self._check_shapes(outputs, mb_size)
                if loss_fn is not None and self.is_loss_stage:
                    target = targets[m] if targets is not None else None
                    live[m] = loss_fn(assemble_output(self.manifest, self.worker.model_outputs(m)), target)
                    losses[m] = live[m].detach()
            elif m in live:
                loss = live.pop(m)
                self.worker.backward(m, [loss * scale], [torch.ones_like(loss)])
            else:
                self.worker.backward(m)
        self.worker.finish_step()
        return losses if self.is_loss_stage else []

    def _check_shapes(self, outputs: Sequence[torch.Tensor], mb_size: int) -> None:
        """Refuse stage outputs whose shapes differ from the manifest's (a stale build directory)."""
        for o, t in zip(self.spec.outputs, outputs):
            want = o.shape_at(mb_size, self.manifest.microbatch_size)
            if tuple(t.shape) != want:
                raise RuntimeSetupError(f"stage {self.stage} output {o.name!r} has shape {tuple(t.shape)} but the "
                                        f"manifest says {want} at microbatch size {mb_size}; rebuild the directory")
