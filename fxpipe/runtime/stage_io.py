"""``StageWorker``: ``F(m)`` and ``B(m)`` of one stage, with their messages to the other stages.

Note [implied communication]: actions name only computation; the messages follow from
the routes. ``F`` of stage s on microbatch m first receives m's activations from every
producer of s, runs the stage, and sends its outputs to every consumer (in the
manifest's dtype: under the user's autocast a stage may compute in a lower precision).
``B`` receives the gradients of s's outputs from the consumers (summed when several
consume one tensor, cast to the output's dtype), backpropagates them together with any
tensors of the caller's (the loss), and sends the gradients of the received inputs
back, only for tensors that need one (``routes.needs_grad``). Receive buffers are
allocated from the manifest's specs at the microbatch size, so no shapes are exchanged
at run time.

Sends never block: they are waited on only in ``finish_step``. Receives block right
before the computation that needs them. With ``pair_sends=True`` the sends of one
action are posted in the same ``batch_isend_irecv`` call as the receives of the next
(so NCCL sees each pair of neighbours post matching groups); that is for a caller that
runs actions back to back (``StageExecutor``). A caller that runs user code between
actions (``StepDriver``) posts each action's sends right away, since the user's code
may block on something the peers can only reach after receiving them.

Used by ``fxpipe.runtime.executor`` (a schedule's actions, ``loss_fn`` on the last
stage) and ``fxpipe.smp.driver`` (the user's ``@step`` function).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fxpipe.codegen.manifest import INPUT, BoundaryTensor, Manifest
from fxpipe.codegen.outputs import rebuild_output
from fxpipe.errors import RuntimeSetupError
from fxpipe.runtime.p2p import P2P, Message
from fxpipe.runtime.routes import Routes

__all__ = ["StageWorker", "assemble_output", "boundary_dtype", "microbatch_size"]


def boundary_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (a manifest's boundary tensor dtype)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise RuntimeSetupError(f"boundary tensor dtype {name!r} cannot be sent between stages; "
                                "only tensors of a torch dtype may cross a stage boundary")
    return dtype


def microbatch_size(manifest: Manifest, inputs: Sequence[torch.Tensor]) -> int:
    """The microbatch size of ``inputs``, read from the first model input with a batch dim."""
    for spec, t in zip(manifest.inputs, inputs):
        if spec.batch_dim is not None:
            per_sample = max(spec.shape[spec.batch_dim] // manifest.microbatch_size, 1)
            return t.shape[spec.batch_dim] // per_sample
    return manifest.microbatch_size


def assemble_output(manifest: Manifest, flat: Sequence[torch.Tensor]) -> Any:
    """The model's output structure from its flattened outputs (what a loss function expects;
    Note [output structure] in ``fxpipe.codegen.outputs``)."""
    return rebuild_output(manifest, list(flat))


@dataclass
class _Microbatch:
    """What one microbatch keeps on this stage between its forward and its backward."""

    mb_size: int
    received: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: tuple[torch.Tensor, ...] = ()


class StageWorker:
    """Runs ``F(m)`` / ``B(m)`` of ``stage`` (``module``) and exchanges their messages (see the Note).

    Example (one step; the caller decides the order of the actions)::

        worker = StageWorker(manifest, routes, stage, module, p2p, device, pair_sends=True)
        outputs = worker.forward(0, inputs, mb_size)
        worker.backward(0)            # on the last stage: worker.backward(0, [loss], [torch.ones_like(loss)])
        worker.finish_step()
    """

    def __init__(self, manifest: Manifest, routes: Routes, stage: int, module: nn.Module, p2p: P2P,
                 device: torch.device, pair_sends: bool) -> None:
        self.manifest, self.routes, self.stage, self.module = manifest, routes, stage, module
        self.spec = manifest.stage(stage)
        self.p2p, self.device = p2p, device
        self.pair_sends = pair_sends
        self._recvs, self._sends = routes.recvs(stage), routes.sends(stage)
        self._states: dict[int, _Microbatch] = {}
        self._pending: list[Message] = []   # sends waiting to be posted with the next receives
        self._in_flight: list[tuple[dist.Work, str]] = []     # posted sends, waited on in finish_step

    def __contains__(self, m: int) -> bool:
        """Whether microbatch ``m`` ran its forward here and awaits its backward."""
        return m in self._states

    # -- actions ---------------------------------------------------------------

    def forward(self, m: int, inputs: Sequence[torch.Tensor], mb_size: int) -> tuple[torch.Tensor, ...]:
        """``F(m)`` on the model inputs ``inputs`` (microbatch size ``mb_size``); this stage's outputs.

        Runs under the caller's grad mode (an evaluation step may run in ``no_grad``).
        """
        state = self._states[m] = _Microbatch(mb_size)
        T, recvs = self.routes.num_tensors, []
        for t in self._recvs:
            buf = self._empty(t.spec, mb_size)
            state.received[t.spec.name] = buf
            recvs.append(Message(buf, t.src, t.tag(m, T, False), f"microbatch {m} activation {t.spec.name!r}"))
        self._exchange(recvs)
        for t in self._recvs:
            if t.grad:
                state.received[t.spec.name].requires_grad_(True)
        by_name = dict(zip(self.routes.input_names, inputs))
        args = [by_name[i.name].to(self.device) if i.producer == INPUT else state.received[i.name]
                for i in self.spec.inputs]
        out = self.module(*args)
        state.outputs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if len(state.outputs) != len(self.spec.outputs):
            raise RuntimeSetupError(f"stage {self.stage} returned {len(state.outputs)} tensors but the manifest lists "
                                    f"{len(self.spec.outputs)} outputs; the stage file and manifest disagree, "
                                    "rebuild the directory")
        mine = dict(zip((o.name for o in self.spec.outputs), state.outputs))
        self._send([Message(mine[t.spec.name].detach().to(boundary_dtype(t.spec.dtype)).contiguous(), t.dst,
                            t.tag(m, T, False), f"microbatch {m} activation {t.spec.name!r}") for t in self._sends])
        return state.outputs

    def model_outputs(self, m: int) -> list[torch.Tensor]:
        """The flat model outputs of microbatch ``m``: this stage's and those received (on the last stage)."""
        state = self._states[m]
        mine = dict(zip((o.name for o in self.spec.outputs), state.outputs))
        return [mine[n] if n in mine else state.received[n] for n in self.routes.model_outputs]

    def backward(self, m: int, tensors: Sequence[torch.Tensor] = (), grads: Sequence[torch.Tensor] = ()) -> None:
        """``B(m)``: backpropagate the received output gradients plus ``tensors`` with ``grads``."""
        state = self._states.pop(m)
        T, recvs, grads_in = self.routes.num_tensors, [], []
        for t in self._sends:
            if t.grad:
                buf = self._empty(t.spec, state.mb_size)
                grads_in.append((t.spec.name, buf))
                recvs.append(Message(buf, t.dst, t.tag(m, T, True), f"microbatch {m} gradient of {t.spec.name!r}"))
        self._exchange(recvs)
        roots: list[torch.Tensor] = []
        root_grads: list[torch.Tensor] = []
        for o, value in zip(self.spec.outputs, state.outputs):
            g = [buf for name, buf in grads_in if name == o.name]
            if g and value.requires_grad:
                roots.append(value)
                summed = torch.stack(g).sum(0) if len(g) > 1 else g[0]
                root_grads.append(summed.to(value.dtype))  # the output may be in autocast's dtype
        roots += tensors
        root_grads += grads
        if roots:
            torch.autograd.backward(roots, root_grads)
        sends = []
        for t in self._recvs:
            if t.grad:
                buf = state.received[t.spec.name]
                grad = buf.grad if buf.grad is not None else torch.zeros_like(buf)
                sends.append(Message(grad, t.src, t.tag(m, T, True), f"microbatch {m} gradient of {t.spec.name!r}"))
        self._send(sends)

    def discard(self, m: int) -> None:
        """Forget microbatch ``m`` without a backward (it ran forward only, e.g. an evaluation step)."""
        self._states.pop(m, None)

    def finish_step(self) -> None:
        """Post the last sends and wait for every send of the step."""
        in_flight = self._in_flight + self.p2p.post(self._pending, [])
        self._pending, self._in_flight = [], []
        self.p2p.wait(in_flight)

    # -- messages --------------------------------------------------------------

    def _empty(self, spec: BoundaryTensor, mb_size: int) -> torch.Tensor:
        shape = spec.shape_at(mb_size, self.manifest.microbatch_size)
        return torch.empty(shape, dtype=boundary_dtype(spec.dtype), device=self.device)

    def _exchange(self, recvs: list[Message]) -> None:
        """Post the pending sends with ``recvs`` and wait for the receives only."""
        sends, self._pending = self._pending, []
        posted = self.p2p.post(sends, recvs)
        self._in_flight += posted[:len(sends)]
        self.p2p.wait(posted[len(sends):])

    def _send(self, sends: list[Message]) -> None:
        if self.pair_sends:
            self._pending = sends
        else:
            self._in_flight += self.p2p.post(sends, [])
