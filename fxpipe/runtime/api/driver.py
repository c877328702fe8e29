"""``StepDriver``: one training step's pipeline traffic on this rank, driven by the user's code.

Note [user-driven schedule]: the ``@step`` function runs once per microbatch on every
rank. ``model(...)`` of microbatch m is this stage's ``F(m)``: receive the activations
from the producer stages, run the stage, post the sends to the consumers (never
waited on until the end of the step, so several microbatches are in flight).
``model.backward(...)`` of microbatch m *requests* ``B(m)``. The order in which the
actions run is the runtime's schedule (``fxpipe.runtime.schedule``: ``gpipe`` for
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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from fxpipe.codegen.manifest import INPUT, BoundaryTensor, Manifest
from fxpipe.errors import FxpipeError, RuntimeSetupError
from fxpipe.runtime.executor import assemble_output
from fxpipe.runtime.p2p import P2P, Message
from fxpipe.runtime.routes import Routes
from fxpipe.runtime.schedule import Action, ActionKind, make_schedule

__all__ = ["StepError", "StepDriver", "microbatch_size"]


class StepError(FxpipeError):
    """The model or its backward was used outside a ``@step`` function, or out of order."""


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise RuntimeSetupError(f"boundary tensor dtype {name!r} cannot cross a stage boundary")
    return dtype


def microbatch_size(manifest: Manifest, inputs: Sequence[torch.Tensor]) -> int:
    """The microbatch size of ``inputs``, read from the first model input with a batch dim."""
    for spec, t in zip(manifest.inputs, inputs):
        if spec.batch_dim is not None:
            per_sample = max(spec.shape[spec.batch_dim] // manifest.microbatch_size, 1)
            return t.shape[spec.batch_dim] // per_sample
    return manifest.microbatch_size


@dataclass
class _Microbatch:
    """What one microbatch keeps on this stage between its forward and its backward."""

    received: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: tuple[torch.Tensor, ...] = ()
    user: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
    mb_size: int = 0


class StepDriver:
    """Runs this rank's ``F``/``B`` actions of one step, in schedule order (see the Note)."""

    def __init__(self, manifest: Manifest, routes: Routes, stage: int, module: nn.Module, p2p: P2P,
                 device: torch.device, schedule: str, microbatches: int, average: bool) -> None:
        self.manifest, self.routes, self.stage, self.module = manifest, routes, stage, module
        self.spec = manifest.stage(stage)
        self.p2p, self.device = p2p, device
        self.microbatches = microbatches
        self.scale = 1.0 / microbatches if average else 1.0
        self.is_last = stage == routes.loss_stage
        self.actions: tuple[Action, ...] = make_schedule(schedule, manifest.num_stages, microbatches).rank_actions(
            stage)
        self.pos = 0
        self.states: dict[int, _Microbatch] = {}
        self.requested: set[int] = set()
        self.finished: set[int] = set()   # microbatches whose user function returned
        self.sends: list[Any] = []
        self.backward_ran = False
        self._recvs, self._sends = routes.recvs(stage), routes.sends(stage)
        self._outputs = {o.name: o for s in manifest.stages for o in s.outputs}

    # -- the user's calls ------------------------------------------------------

    def forward(self, m: int, inputs: Sequence[torch.Tensor]) -> Any:
        """``F(m)`` with the model inputs ``inputs``; the model output (or placeholders)."""
        if m in self.states:
            raise StepError(f"the model was called twice in microbatch {m}; call it once per @step function call")
        self._run_until(Action(self.stage, ActionKind.FORWARD, m))
        self.pos += 1
        state = self.states[m] = _Microbatch(mb_size=microbatch_size(self.manifest, inputs))
        self._forward(m, state, inputs)
        if self.is_last:
            mine = dict(zip((o.name for o in self.spec.outputs), state.outputs))
            flat = [mine[n] if n in mine else state.received[n] for n in self.routes.model_outputs]
        else:
            flat = [self._placeholder(self._outputs[n], state.mb_size) for n in self.routes.model_outputs]
        return assemble_output(self.manifest, flat)

    def backward(self, m: int, tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None] | None) -> None:
        """Request ``B(m)``; on the last stage ``tensors``/``grads`` are what to backpropagate."""
        state = self.states.get(m)
        if state is None:
            raise StepError(f"model.backward was called in microbatch {m} before the model was called; "
                            "call model(...) first, then model.backward(loss)")
        if m in self.requested:
            raise StepError(f"model.backward was called twice in microbatch {m}; accumulate the losses and call it "
                            "once (retain_graph is not supported)")
        if self.is_last:
            state.user = self._user_grads(tensors, grads)
        self.requested.add(m)
        while self.pos < len(self.actions) and self.actions[self.pos].kind is ActionKind.BACKWARD \
                and self.actions[self.pos].microbatch in self.requested:
            self._backward(self.actions[self.pos].microbatch)
            self.pos += 1

    def microbatch_done(self, m: int) -> None:
        """The user function of microbatch ``m`` returned (so no more requests for it)."""
        self.finished.add(m)

    def finish(self) -> bool:
        """Run the remaining actions and wait for every send; whether any backward ran."""
        self._run_until(None)
        self.p2p.wait(self.sends)
        self.sends = []
        return self.backward_ran

    # -- scheduling ------------------------------------------------------------

    def _run_until(self, target: Action | None) -> None:
        while self.pos < len(self.actions):
            action = self.actions[self.pos]
            if action == target:
                return
            m = action.microbatch
            if action.kind is ActionKind.FORWARD:
                what = "the step ended" if target is None else f"the model was called in microbatch {target.microbatch}"
                raise StepError(f"{what}, but microbatch {m} never called the model on stage {self.stage}; call "
                                "model(...) exactly once in every call of the @step function")
            if m in self.requested:
                self._backward(m)
            elif m not in self.finished:
                raise StepError(f"microbatch {m} has not finished its @step function call")
            else:
                self.states.pop(m, None)  # forward only: no backward for this microbatch
            self.pos += 1
        if target is not None:
            raise StepError(f"{target} is not in this step's schedule: the @step function ran more microbatches "
                            f"than the {self.microbatches} configured")

    # -- computation -----------------------------------------------------------

    def _placeholder(self, spec: BoundaryTensor, mb_size: int) -> torch.Tensor:
        dtype = _dtype(spec.dtype)
        t = torch.zeros(spec.shape_at(mb_size, self.manifest.microbatch_size), dtype=dtype, device=self.device)
        return t.requires_grad_(True) if dtype.is_floating_point else t

    def _user_grads(self, tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None] | None
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        tensors = list(tensors)
        grads = list(grads) if grads is not None else [None] * len(tensors)
        if len(grads) != len(tensors):
            raise StepError(f"model.backward got {len(tensors)} tensors but {len(grads)} grad_tensors")
        out = []
        for t, g in zip(tensors, grads):
            if g is None:
                if t.numel() != 1:
                    raise StepError(f"model.backward: a tensor of shape {tuple(t.shape)} needs a grad_tensors "
                                    "entry (only one-element tensors, such as a loss, get an implicit gradient)")
                g = torch.ones_like(t)
            out.append(g * self.scale if self.scale != 1.0 else g)
        return tensors, out

    def _forward(self, m: int, state: _Microbatch, inputs: Sequence[torch.Tensor]) -> None:
        T, recvs = self.routes.num_tensors, []
        for t in self._recvs:
            buf = torch.empty(t.spec.shape_at(state.mb_size, self.manifest.microbatch_size),
                              dtype=_dtype(t.spec.dtype), device=self.device)
            state.received[t.spec.name] = buf
            recvs.append(Message(buf, t.src, t.tag(m, T, False), f"microbatch {m} activation {t.spec.name!r}"))
        self.p2p.wait(self.p2p.post([], recvs))
        for t in self._recvs:
            if t.grad:
                state.received[t.spec.name].requires_grad_(True)
        by_name = dict(zip(self.routes.input_names, inputs))
        args = [by_name[i.name].to(self.device) if i.producer == INPUT else state.received[i.name]
                for i in self.spec.inputs]
        out = self.module(*args)  # under the caller's grad mode: an evaluation step may run in no_grad
        state.outputs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if len(state.outputs) != len(self.spec.outputs):
            raise RuntimeSetupError(f"stage {self.stage} returned {len(state.outputs)} tensors but the manifest lists "
                                    f"{len(self.spec.outputs)}; the build directory is inconsistent, rebuild it")
        mine = dict(zip((o.name for o in self.spec.outputs), state.outputs))
        # under the user's autocast a stage may compute in a lower precision: send the manifest's dtype
        sends = [Message(mine[t.spec.name].detach().to(_dtype(t.spec.dtype)).contiguous(), t.dst, t.tag(m, T, False),
                         f"microbatch {m} activation {t.spec.name!r}") for t in self._sends]
        self.sends += self.p2p.post(sends, [])

    def _backward(self, m: int) -> None:
        state = self.states.pop(m)
        T, recvs, grads_in = self.routes.num_tensors, [], []
        for t in self._sends:
            if t.grad:
                buf = torch.empty(t.spec.shape_at(state.mb_size, self.manifest.microbatch_size),
                                  dtype=_dtype(t.spec.dtype), device=self.device)
                grads_in.append((t.spec.name, buf))
                recvs.append(Message(buf, t.dst, t.tag(m, T, True), f"microbatch {m} gradient of {t.spec.name!r}"))
        self.p2p.wait(self.p2p.post([], recvs))
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for o, out in zip(self.spec.outputs, state.outputs):
            g = [buf for name, buf in grads_in if name == o.name]
            if g and out.requires_grad:
                tensors.append(out)
                grad = torch.stack(g).sum(0) if len(g) > 1 else g[0]
                grads.append(grad.to(out.dtype))  # the output may be in autocast's dtype
        if state.user is not None:
            tensors += state.user[0]
            grads += state.user[1]
        if tensors:
            torch.autograd.backward(tensors, grads)
        self.backward_ran = True
        sends = []
        for t in self._recvs:
            if t.grad:
                buf = state.received[t.spec.name]
                g = buf.grad if buf.grad is not None else torch.zeros_like(buf)
                sends.append(Message(g, t.src, t.tag(m, T, True), f"microbatch {m} gradient of {t.spec.name!r}"))
        self.sends += self.p2p.post(sends, [])
