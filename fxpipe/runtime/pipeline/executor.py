"""``RankExecutor``: runs one rank's schedule actions for one training step.

The rank holds one stage, or several (interleaved and V-shaped schedules); each has a
``StageWorker``, and all share the rank's ``RankComm``. The messages of each action
follow from the routes (Note [implied communication] in ``fxpipe.runtime.pipeline.stage_io``);
this module walks the action list, computes the loss on the loss stage, and decides
when receives are posted (Note [posting messages] in ``fxpipe.runtime.pipeline.comm``): on
gloo every receive of the step is posted when the step starts, so each send finds its
receive already announced; on NCCL (``pair_sends``) an action's sends go out with the
next action's receives. Sends are waited for once, at the end of the step. ``B`` is
split where the schedule has a ``W`` for it (Note [split backward] in
``fxpipe.partitioner.schedule.actions``). With non-blocking sends a schedule is
deadlock-free exactly when ``validate.simulate`` finishes it, which ``PipelineRunner``
checks up front, so any valid action list runs, a user's own included.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from fxpipe.codegen.manifest import Manifest
from fxpipe.errors import RuntimeSetupError
from fxpipe.runtime.pipeline.comm import RankComm
from fxpipe.runtime.pipeline.p2p import P2P
from fxpipe.runtime.pipeline.routes import Routes
from fxpipe.runtime.pipeline.schedule import Action, ActionKind, Schedule
from fxpipe.runtime.pipeline.stage_io import Pending, StageWorker, assemble_output, microbatch_size

__all__ = ["RankExecutor", "assemble_output", "LossFn", "ActionTime"]

LossFn = Callable[[Any, Any], torch.Tensor]
F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT


@dataclass(frozen=True)
class ActionTime:
    """When one action of the last step computed (``time.perf_counter`` seconds), after its receives arrived."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class _Step:
    """One action, resolved once: its worker, whether its backward is split, whether it receives."""

    action: Action
    worker: StageWorker
    split: bool
    receives: bool


class RankExecutor:
    """Executes ``schedule``'s actions of pipeline rank ``rank``, whose stages are ``modules``."""

    def __init__(
        self,
        manifest: Manifest,
        routes: Routes,
        rank: int,
        modules: Mapping[int, nn.Module],
        schedule: Schedule,
        p2p: P2P,
        device: torch.device,
        average_grads: bool = True,
        pair_sends: bool = False,
        recompute: Sequence[int] = (),
        autocast: torch.dtype | None = None,
        weight_params: Mapping[int, Sequence[torch.Tensor]] | None = None,
    ) -> None:
        self.manifest = manifest
        self.schedule = schedule
        self.rank = rank
        self.average_grads = average_grads
        self.loss_stage = routes.loss_stage
        self.comm = RankComm(p2p, device, pair_sends)
        self.workers = {
            s: StageWorker(
                manifest,
                routes,
                s,
                m,
                p2p,
                device,
                pair_sends,
                comm=self.comm,
                local_stages=tuple(modules),
                recompute=s in recompute,
                autocast=autocast,
                weight_params=(weight_params or {}).get(s),
            )
            for s, m in modules.items()
        }
        split = schedule.split_backward()
        self._steps = []
        for a in schedule.rank_actions(rank):
            worker = self.workers.get(a.stage)
            if worker is None:
                raise RuntimeSetupError(
                    f"schedule {schedule.name!r} gives rank {rank} action {a}, but this rank "
                    f"holds stages {sorted(modules)}"
                )
            receives = worker.receives(a.kind.value)
            self._steps.append(_Step(a, worker, (a.stage, a.microbatch) in split, receives))
        self.last_step: list[ActionTime] = []

    @property
    def holds_loss(self) -> bool:
        return self.loss_stage in self.workers

    def _post(self, step: _Step, mb_size: int) -> Pending:
        a = step.action
        if a.kind is F:
            return step.worker.post_forward(a.microbatch, mb_size)
        return step.worker.post_backward(a.microbatch, mb_size)

    def run(
        self,
        inputs: Sequence[tuple[torch.Tensor, ...]],
        targets: Sequence[Any] | None,
        loss_fn: LossFn | None,
    ) -> list[torch.Tensor]:
        """Run this rank's actions on the microbatches; return the per-microbatch losses
        (detached) on the rank of the loss stage and ``[]`` elsewhere. Gradients accumulate in ``.grad``."""
        M = len(inputs)
        if M != self.schedule.num_microbatches:
            raise RuntimeSetupError(
                f"got {M} microbatches but the schedule was made for "
                f"{self.schedule.num_microbatches}"
            )
        if self.holds_loss and loss_fn is None:
            raise RuntimeSetupError("the last stage needs a loss_fn to train")
        mb_size = microbatch_size(self.manifest, inputs[0])
        # the step's dynamic sizes, read off the model inputs every rank holds: checked before any message
        sizes = self.manifest.step_sizes([tuple(t.shape) for t in inputs[0]])
        for worker in self.workers.values():
            worker.sizes = sizes
        scale = 1.0 / M if self.average_grads else 1.0
        live: dict[int, torch.Tensor] = {}  # losses between their microbatch's F and B
        losses: list[torch.Tensor] = [torch.zeros(())] * M
        steps = self._steps
        posted: dict[int, Pending] = {}
        if not self.comm.pair_sends:  # gloo: every receive of the step, before any action computes
            posted = {i: self._post(step, mb_size) for i, step in enumerate(steps) if step.receives}
        timeline: list[ActionTime] = []
        for i, step in enumerate(steps):
            pending = posted.pop(i, None)
            a, worker = step.action, step.worker
            m = a.microbatch
            if a.kind is F:
                if pending is None:
                    pending = worker.post_forward(m, mb_size)
                self.comm.wait(pending.posted)
                start = time.perf_counter()
                # the outputs' shapes are checked there, before any is sent
                worker.forward(m, inputs[m], mb_size, dataclasses.replace(pending, posted=[]))
                if loss_fn is not None and a.stage == self.loss_stage:
                    target = targets[m] if targets is not None else None
                    live[m] = loss_fn(
                        assemble_output(self.manifest, worker.model_outputs(m)), target
                    )
                    losses[m] = live[m].detach()
            elif a.kind is B:
                if pending is None:
                    pending = self._post(step, mb_size)
                self.comm.wait(pending.posted)
                start = time.perf_counter()
                done = dataclasses.replace(pending, posted=[])
                if m in live:
                    loss = live.pop(m)
                    worker.backward(
                        m, [loss * scale], [torch.ones_like(loss)], pending=done, split=step.split
                    )
                else:
                    worker.backward(m, pending=done, split=step.split)
            else:
                start = time.perf_counter()
                worker.weight(m)
            timeline.append(ActionTime(a, start, time.perf_counter()))
        self.comm.finish()
        self.last_step = timeline
        return losses if self.holds_loss else []
