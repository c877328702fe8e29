"""``StepDriver``: one training step's pipeline traffic on this rank, driven by the user's code.

Note [user-driven schedule]: the ``@step`` function runs once per microbatch on every
rank. ``model(...)`` of microbatch m is this stage's ``F(m)``: receive the activations
from the producer stages, run the stage, post the sends to the consumers (never
waited on until the end of the step, so several microbatches are in flight).
``model.backward(...)`` of microbatch m *requests* ``B(m)``. The order in which the
actions run is the runtime's schedule (``fxpipe.runtime.pipeline.schedule``: ``gpipe`` for
``pipeline="simple"``, ``1f1b`` for ``"interleaved"``): before ``F(m)`` the driver runs
every requested backward that the schedule puts earlier, after a request it runs the
backwards that are now due, and at the end of the step the rest. So on a non-last
stage GPipe defers all backwards to after the forwards, and 1F1B interleaves them.

On the last stage ``model(...)`` returns the real model output and ``B(m)``
backpropagates the user's tensors (scaled by 1/M when averaging over microbatches).
Elsewhere it returns zero placeholders of the right shape (from the manifest's output
specs) so the user's loss code runs unchanged; ``B(m)`` there backpropagates the
gradients received from the consumers instead, and the user's tensors are ignored. A
microbatch whose function returned without ``model.backward`` (an evaluation step)
has no ``B``.

The mechanics of ``F(m)``/``B(m)`` (receives, sends, dtype casts) are
``fxpipe.runtime.pipeline.stage_io.StageWorker``'s; this module only orders them. User code runs
between the actions, so each action's sends are posted right away (``pair_sends=False``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from fxpipe.codegen.manifest import BoundaryTensor, Manifest
from fxpipe.errors import StepError
from fxpipe.runtime.pipeline.p2p import P2P
from fxpipe.runtime.pipeline.routes import Routes
from fxpipe.runtime.pipeline.schedule import Action, ActionKind, make_schedule
from fxpipe.runtime.pipeline.stage_io import (
    StageWorker,
    assemble_output,
    boundary_dtype,
    microbatch_size,
)

__all__ = [
    "StepError",
    "StepDriver",
    "microbatch_size",
    "placeholder",
    "user_grads",
    "check_backward_request",
]


def check_backward_request(m: int, called: bool, requested: set[int]) -> None:
    """Refuse ``model.backward`` in microbatch ``m`` before ``model(...)`` (``called``) or a second time."""
    if not called:
        raise StepError(
            f"model.backward was called in microbatch {m} before the model was called; "
            "call model(...) first, then model.backward(loss)"
        )
    if m in requested:
        raise StepError(
            f"model.backward was called twice in microbatch {m}; accumulate the losses and call it "
            "once (retain_graph is not supported)"
        )


def placeholder(
    manifest: Manifest,
    spec: BoundaryTensor,
    mb_size: int,
    device: torch.device,
    sizes: dict[str, int] | None = None,
) -> torch.Tensor:
    """Zeros shaped like model output ``spec`` at ``mb_size`` (and the step's dynamic ``sizes``): what a
    rank without the loss stage returns."""
    dtype = boundary_dtype(spec.dtype)
    t = torch.zeros(
        spec.shape_at(mb_size, manifest.microbatch_size, sizes), dtype=dtype, device=device
    )
    return t.requires_grad_(True) if dtype.is_floating_point else t


def user_grads(
    tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None] | None, scale: float
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``model.backward(tensors, grads)``'s roots and their gradients (implicit ones for scalars), times ``scale``."""
    tensors = list(tensors)
    given = list(grads) if grads is not None else [None] * len(tensors)
    if len(given) != len(tensors):
        raise StepError(f"model.backward got {len(tensors)} tensors but {len(given)} grad_tensors")
    out = []
    for t, g in zip(tensors, given):
        if g is None:
            if t.numel() != 1:
                raise StepError(
                    f"model.backward: a tensor of shape {tuple(t.shape)} needs a grad_tensors "
                    "entry (only one-element tensors, such as a loss, get an implicit gradient)"
                )
            g = torch.ones_like(t)
        out.append(g * scale if scale != 1.0 else g)
    return tensors, out


class StepDriver:
    """Runs this rank's ``F``/``B`` actions of one step, in schedule order (see the Note)."""

    def __init__(
        self,
        manifest: Manifest,
        routes: Routes,
        stage: int,
        module: nn.Module,
        p2p: P2P,
        device: torch.device,
        schedule: str,
        microbatches: int,
        average: bool,
    ) -> None:
        self.manifest, self.routes, self.stage = manifest, routes, stage
        self.device = device
        self.microbatches = microbatches
        self.scale = 1.0 / microbatches if average else 1.0
        self.is_last = stage == routes.loss_stage
        plan = make_schedule(schedule, manifest.num_stages, microbatches)
        self.actions: tuple[Action, ...] = plan.rank_actions(stage)
        self.split = plan.split_backward()
        self.worker = StageWorker(manifest, routes, stage, module, p2p, device, pair_sends=False)
        self.pos = 0
        self.user: dict[
            int, tuple[list[torch.Tensor], list[torch.Tensor]]
        ] = {}  # last stage: what to backprop
        self.requested: set[int] = set()
        self.finished: set[int] = set()  # microbatches whose user function returned
        self.backward_ran = False
        self._outputs = {o.name: o for s in manifest.stages for o in s.outputs}

    # -- the user's calls ------------------------------------------------------

    def forward(self, m: int, inputs: Sequence[torch.Tensor]) -> Any:
        """``F(m)`` with the model inputs ``inputs``; the model output (or placeholders)."""
        if m in self.worker:
            raise StepError(
                f"the model was called twice in microbatch {m}; call it once per @step function call"
            )
        # the step's dynamic sizes (Note [shape formulas]), checked before any message of this microbatch
        sizes = self.manifest.step_sizes([tuple(t.shape) for t in inputs])
        self._run_until(Action(self.stage, ActionKind.FORWARD, m))
        self.pos += 1
        mb_size = microbatch_size(self.manifest, inputs)
        self.worker.sizes = sizes
        self.worker.forward(m, inputs, mb_size)
        if self.is_last:
            flat = self.worker.model_outputs(m)
        else:
            flat = [
                placeholder(self.manifest, self._outputs[n], mb_size, self.device, sizes)
                for n in self.routes.model_outputs
            ]
        return assemble_output(self.manifest, flat)

    def backward(
        self, m: int, tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None] | None
    ) -> None:
        """Request ``B(m)``; on the last stage ``tensors``/``grads`` are what to backpropagate."""
        check_backward_request(m, m in self.worker, self.requested)
        if self.is_last:
            self.user[m] = user_grads(tensors, grads, self.scale)
        self.requested.add(m)
        while self.pos < len(self.actions):
            action = self.actions[self.pos]
            if action.kind is ActionKind.BACKWARD and action.microbatch in self.requested:
                self._backward(action.microbatch)
            elif action.kind is ActionKind.WEIGHT and self.worker.has_pending_weight(
                action.microbatch
            ):
                self.worker.weight(action.microbatch)
            else:
                break
            self.pos += 1

    def microbatch_done(self, m: int) -> None:
        """The user function of microbatch ``m`` returned (so no more requests for it)."""
        self.finished.add(m)

    def finish(self) -> bool:
        """Run the remaining actions and wait for every send; whether any backward ran."""
        self._run_until(None)
        self.worker.finish_step()
        return self.backward_ran

    # -- scheduling ------------------------------------------------------------

    def _run_until(self, target: Action | None) -> None:
        while self.pos < len(self.actions):
            action = self.actions[self.pos]
            if action == target:
                return
            m = action.microbatch
            if action.kind is ActionKind.WEIGHT:
                if self.worker.has_pending_weight(m):
                    self.worker.weight(m)
                self.pos += 1  # else the microbatch ran forward only: nothing to do
                continue
            if action.kind is ActionKind.FORWARD:
                what = (
                    "the step ended"
                    if target is None
                    else f"the model was called in microbatch {target.microbatch}"
                )
                raise StepError(
                    f"{what}, but microbatch {m} never called the model on stage {self.stage}; call "
                    "model(...) exactly once in every call of the @step function"
                )
            if m in self.requested:
                self._backward(m)
            elif m not in self.finished:
                raise StepError(f"microbatch {m} has not finished its @step function call")
            else:
                self.worker.discard(m)  # forward only: no backward for this microbatch
            self.pos += 1
        if target is not None:
            raise StepError(
                f"{target} is not in this step's schedule: the @step function ran more microbatches "
                f"than the {self.microbatches} configured"
            )

    def _backward(self, m: int) -> None:
        tensors, grads = self.user.pop(m, ([], []))
        self.worker.backward(m, tensors, grads, split=(self.stage, m) in self.split)
        self.backward_ran = True
