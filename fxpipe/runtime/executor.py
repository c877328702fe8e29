"""``StageExecutor``: runs one stage's schedule actions for one training step.

Note [implied communication]: actions name only computation; the messages follow from
the routes. ``F`` of stage s on microbatch m first receives m's activations from every
producer of s, and afterwards sends its outputs to every consumer. ``B`` receives
the gradients of s's outputs from the consumers (summed when several consume one
tensor), backpropagates, and sends the gradients of the received inputs back. Receive
buffers are allocated from the manifest's specs at the microbatch size, so no shapes
are exchanged at run time.

Sends never block: the sends of one action are posted in the same
``batch_isend_irecv`` call as the receives of the next action (so NCCL sees each pair
of neighbours post matching groups), and waited on only at the end of the step.
Receives block right before the computation that needs them. With non-blocking sends
a schedule is deadlock-free exactly when ``validate.simulate`` finishes it, which
``StageExecutor`` checks up front.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_unflatten

from fxpipe.codegen.manifest import INPUT, Manifest
from fxpipe.errors import RuntimeSetupError
from fxpipe.runtime.p2p import P2P, Message
from fxpipe.runtime.routes import Routes
from fxpipe.runtime.schedule import Action, ActionKind, Schedule

__all__ = ["StageExecutor", "assemble_output"]

LossFn = Callable[[Any, Any], torch.Tensor]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise RuntimeSetupError(f"boundary tensor dtype {name!r} cannot be sent between stages; "
                                "only tensors of a torch dtype may cross a stage boundary")
    return dtype


def assemble_output(manifest: Manifest, flat: Sequence[torch.Tensor]) -> Any:
    """The model's output structure from its flattened outputs (what ``loss_fn`` expects)."""
    if manifest.output_spec:
        from torch.utils._pytree import treespec_loads

        return tree_unflatten(list(flat), treespec_loads(manifest.output_spec))
    return flat[0] if len(flat) == 1 else tuple(flat)


@dataclass
class _Microbatch:
    """What one microbatch keeps on this stage between its forward and backward."""

    received: dict[str, torch.Tensor] = field(default_factory=dict)
    grads_in: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    outputs: tuple[torch.Tensor, ...] = ()
    loss: torch.Tensor | None = None


class StageExecutor:
    """Executes ``schedule``'s actions for ``stage`` with ``module`` as that stage."""

    def __init__(self, manifest: Manifest, routes: Routes, stage: int, module: nn.Module,
                 schedule: Schedule, p2p: P2P, device: torch.device, average_grads: bool = True) -> None:
        self.manifest = manifest
        self.routes = routes
        self.stage = stage
        self.spec = manifest.stage(stage)
        self.module = module
        self.schedule = schedule
        self.actions = schedule.rank_actions(schedule.stage_ranks[stage])
        self.p2p = p2p
        self.device = device
        self.average_grads = average_grads
        self.is_loss_stage = stage == routes.loss_stage
        self._recvs = routes.recvs(stage)
        self._sends = routes.sends(stage)
        if any(a.kind is ActionKind.WEIGHT for a in self.actions):
            raise RuntimeSetupError(f"schedule {schedule.name!r} has W (weight-gradient) actions, which this "
                                    "executor does not split from B yet; use 'gpipe' or '1f1b'")

    # -- messages --------------------------------------------------------------

    def _shape(self, transfer_spec: Any, mb_size: int) -> tuple[int, ...]:
        return transfer_spec.shape_at(mb_size, self.manifest.microbatch_size)

    def _recv_messages(self, action: Action, state: _Microbatch, mb_size: int) -> list[Message]:
        m, T = action.microbatch, self.routes.num_tensors
        msgs = []
        if action.kind is ActionKind.FORWARD:
            for t in self._recvs:
                buf = torch.empty(self._shape(t.spec, mb_size), dtype=_dtype(t.spec.dtype), device=self.device)
                state.received[t.spec.name] = buf
                msgs.append(Message(buf, t.src, t.tag(m, T, False), f"microbatch {m} activation {t.spec.name!r}"))
        else:
            for t in self._sends:
                if t.grad:
                    buf = torch.empty(self._shape(t.spec, mb_size), dtype=_dtype(t.spec.dtype), device=self.device)
                    state.grads_in[(t.spec.name, t.dst)] = buf
                    msgs.append(Message(buf, t.dst, t.tag(m, T, True), f"microbatch {m} gradient of {t.spec.name!r}"))
        return msgs

    def _send_messages(self, action: Action, state: _Microbatch, grads_out: dict[str, torch.Tensor]) -> list[Message]:
        m, T = action.microbatch, self.routes.num_tensors
        if action.kind is ActionKind.FORWARD:
            by_name = {o.name: t for o, t in zip(self.spec.outputs, state.outputs)}
            return [Message(by_name[t.spec.name].detach().contiguous(), t.dst, t.tag(m, T, False),
                            f"microbatch {m} activation {t.spec.name!r}") for t in self._sends]
        return [Message(grads_out[t.spec.name], t.src, t.tag(m, T, True),
                        f"microbatch {m} gradient of {t.spec.name!r}") for t in self._recvs if t.grad]

    # -- computation -----------------------------------------------------------

    def _forward(self, m: int, state: _Microbatch, inputs: tuple[torch.Tensor, ...], target: Any,
                 loss_fn: LossFn | None, mb_size: int) -> None:
        for t in self._recvs:
            if t.grad:
                state.received[t.spec.name].requires_grad_(True)
        model_inputs = dict(zip(self.routes.input_names, inputs))
        args = [model_inputs[i.name].to(self.device) if i.producer == INPUT else state.received[i.name]
                for i in self.spec.inputs]
        out = self.module(*args)
        outputs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if len(outputs) != len(self.spec.outputs):
            raise RuntimeSetupError(f"stage {self.stage} returned {len(outputs)} tensors but the manifest lists "
                                    f"{len(self.spec.outputs)} outputs; the stage file and manifest disagree, rebuild")
        for o, t in zip(self.spec.outputs, outputs):
            want = self._shape(o, mb_size)
            if tuple(t.shape) != want:
                raise RuntimeSetupError(f"stage {self.stage} output {o.name!r} has shape {tuple(t.shape)} but the "
                                        f"manifest says {want} at microbatch size {mb_size}; rebuild the directory")
        state.outputs = outputs
        if self.is_loss_stage:
            if loss_fn is None:
                raise RuntimeSetupError("the last stage needs a loss_fn to train")
            mine = dict(zip((o.name for o in self.spec.outputs), outputs))
            flat = [mine[n] if n in mine else state.received[n] for n in self.routes.model_outputs]
            state.loss = loss_fn(assemble_output(self.manifest, flat), target)

    def _backward(self, state: _Microbatch, num_microbatches: int) -> dict[str, torch.Tensor]:
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for o, value in zip(self.spec.outputs, state.outputs):
            g = [buf for (name, _), buf in state.grads_in.items() if name == o.name]
            if g and value.requires_grad:
                tensors.append(value)
                grads.append(torch.stack(g).sum(0) if len(g) > 1 else g[0])
        if state.loss is not None:
            scale = 1.0 / num_microbatches if self.average_grads else 1.0
            tensors.append(state.loss * scale)
            grads.append(torch.ones_like(state.loss))
        if tensors:
            torch.autograd.backward(tensors, grads)
        out = {}
        for t in self._recvs:
            if t.grad:
                buf = state.received[t.spec.name]
                out[t.spec.name] = buf.grad if buf.grad is not None else torch.zeros_like(buf)
        return out

    # -- one step --------------------------------------------------------------

    def run(self, inputs: Sequence[tuple[torch.Tensor, ...]], targets: Sequence[Any] | None,
            loss_fn: LossFn | None) -> list[torch.Tensor]:
        """Run this stage's actions on the microbatches; return the per-microbatch losses
        (detached) on the last stage and ``[]`` elsewhere. Gradients accumulate in ``.grad``."""
        M = len(inputs)
        if M != self.schedule.num_microbatches:
            raise RuntimeSetupError(f"got {M} microbatches but the schedule was made for "
                                    f"{self.schedule.num_microbatches}")
        mb_size = self._microbatch_size(inputs)
        states: dict[int, _Microbatch] = {}
        losses: list[torch.Tensor] = [torch.zeros(())] * M
        pending_sends: list[Message] = []
        in_flight_sends = []
        for action in self.actions:
            m = action.microbatch
            state = states.setdefault(m, _Microbatch())
            recvs = self._recv_messages(action, state, mb_size)
            posted = self.p2p.post(pending_sends, recvs)
            in_flight_sends += posted[:len(pending_sends)]
            self.p2p.wait(posted[len(pending_sends):])
            grads_out: dict[str, torch.Tensor] = {}
            if action.kind is ActionKind.FORWARD:
                target = targets[m] if targets is not None and self.is_loss_stage else None
                self._forward(m, state, inputs[m], target, loss_fn, mb_size)
                if state.loss is not None:
                    losses[m] = state.loss.detach()
            else:
                grads_out = self._backward(state, M)
            pending_sends = self._send_messages(action, state, grads_out)
            if action.kind is ActionKind.BACKWARD:
                del states[m]
        in_flight_sends += self.p2p.post(pending_sends, [])
        self.p2p.wait(in_flight_sends)
        return losses if self.is_loss_stage else []

    def _microbatch_size(self, inputs: Sequence[tuple[torch.Tensor, ...]]) -> int:
        """The microbatch size, read from the first model input that has a batch dim."""
        for spec, t in zip(self.manifest.inputs, inputs[0]):
            if spec.batch_dim is not None:
                per_sample = spec.shape[spec.batch_dim] // self.manifest.microbatch_size
                return t.shape[spec.batch_dim] // max(per_sample, 1)
        return self.manifest.microbatch_size
