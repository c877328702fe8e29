"""``StageWorker``: ``F(m)``, ``B(m)`` and ``W(m)`` of one stage, with their messages to the other stages.

Note [implied communication]: actions name only computation; the messages follow from
the routes. ``F`` of stage s on microbatch m first receives m's activations from every
producer of s, runs the stage, and sends its outputs to every consumer (in the
manifest's dtype, or under ``--precision bf16|fp16`` an fp32 one in the autocast dtype:
``fxpipe.runtime.pipeline.precision.wire_dtype``).
``B`` receives the gradients of s's outputs from the consumers (summed when several
consume one tensor, cast to the output's dtype), backpropagates them together with any
tensors of the caller's (the loss), and sends the gradients of the received inputs
back, only for tensors that need one (``routes.needs_grad``). With ``split=True``, ``B``
computes those input gradients only and ``W`` the weight gradients later (Note [split
backward through the saved graph] in ``fxpipe.runtime.pipeline.split_backward``). Receive
buffers are allocated from the manifest's specs at the microbatch size and the step's dynamic
sizes (``sizes``: each boundary tensor's shape formula evaluated, Note [shape formulas] in
``fxpipe.shapeformula``) and reused from step to step (``RankComm``), so no shapes are exchanged
and nothing is allocated per microbatch once warm. Stages on one rank hand tensors over in memory.

Note [data-dependent messages]: a boundary tensor with a dimension that depends on the data
(formula ``"?"``, Note [data-dependent shapes] in ``fxpipe.tracer.measure.data_shapes``: a packed
``h[mask]``) has no shape its receiver could compute. Its sender sends the shape first, as a small
int64 tensor of its own tag (``Transfer.tag(..., shape=True)``), and the tensor after it; the
receiver posts the shape's receive where it would have posted the tensor's, and once the shape
arrives receives the tensor into a buffer of that shape (allocated for that microbatch, not
pooled: the sizes change from one microbatch to the next). Its gradient needs no such message: the
sender of the activation knows the shape, from the output it sent, and receives the gradient when
``B`` runs. Messages of such tensors go after the others of their action on both sides, so a
backend that matches messages in order (NCCL) pairs them the same way. Every other tensor's
messages are unchanged.

Sends never block: they are waited on only at the end of the step (Note [posting
messages] in ``fxpipe.runtime.pipeline.comm``). A caller that runs actions back to back
(``fxpipe.runtime.pipeline.executor``) posts receives early (``post_forward``, ``post_backward``;
on gloo all of the step's at its start); one that runs user code between actions
(``fxpipe.smp.driver``) lets each action post its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from fxpipe.codegen.manifest import INPUT, BoundaryTensor, Manifest
from fxpipe.codegen.outputs import rebuild_output
from fxpipe.errors import RuntimeSetupError
from fxpipe.runtime.pipeline.comm import Posted, RankComm
from fxpipe.runtime.pipeline.p2p import P2P, Message
from fxpipe.runtime.pipeline.precision import wire_dtype
from fxpipe.runtime.pipeline.recompute import checkpointed
from fxpipe.runtime.pipeline.routes import Routes, Transfer
from fxpipe.runtime.pipeline.split_backward import SplitBackward, WeightWork

__all__ = ["StageWorker", "Pending", "assemble_output", "boundary_dtype", "microbatch_size"]


def boundary_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (a manifest's boundary tensor dtype)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise RuntimeSetupError(
            f"boundary tensor dtype {name!r} cannot be sent between stages; "
            "only tensors of a torch dtype may cross a stage boundary"
        )
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
class Pending:
    """Receives posted for one action: their handles and buffers (by transfer id); ``shapes``: the
    buffers of the shapes of data-dependent tensors (Note [data-dependent messages])."""

    posted: Posted
    buffers: dict[int, torch.Tensor]
    shapes: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class _Microbatch:
    """What one microbatch keeps on this stage between its forward and its last backward action."""

    mb_size: int
    received: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: tuple[torch.Tensor, ...] = ()
    pooled: list[tuple[Any, torch.Tensor]] = field(
        default_factory=list
    )  # buffers to give back when done
    weight: WeightWork | None = None


class StageWorker:
    """Runs ``F(m)`` / ``B(m)`` / ``W(m)`` of ``stage`` (``module``) and exchanges their messages (see the Note).

    ``comm`` is the rank's ``RankComm`` (shared by the stages of one rank); without one the
    worker makes its own over ``p2p`` (one stage per rank). ``local_stages``: the stages on
    this rank, whose tensors are handed over in memory.

    Example (one step; the caller decides the order of the actions)::

        worker = StageWorker(manifest, routes, stage, module, p2p, device, pair_sends=True)
        outputs = worker.forward(0, inputs, mb_size)
        worker.backward(0)            # on the last stage: worker.backward(0, [loss], [torch.ones_like(loss)])
        worker.finish_step()
    """

    def __init__(
        self,
        manifest: Manifest,
        routes: Routes,
        stage: int,
        module: nn.Module,
        p2p: P2P,
        device: torch.device,
        pair_sends: bool,
        *,
        comm: RankComm | None = None,
        local_stages: Sequence[int] = (),
        recompute: bool = False,
        autocast: torch.dtype | None = None,
        weight_params: Sequence[torch.Tensor] | None = None,
    ) -> None:
        self.manifest, self.routes, self.stage, self.module = manifest, routes, stage, module
        self.recompute = (
            recompute  # forward under torch.utils.checkpoint: activations recomputed in backward
        )
        self.spec = manifest.stage(stage)
        # Inputs the stage changes in place get copies of their own (Note [in-place ops across stages] in
        # fxpipe.tracer.frontend.mutation): a received buffer may be sent on or handed to a stage of this rank, a
        # model input is the caller's, and a received tensor that needs a gradient is an autograd leaf,
        # which an in-place op may not change (in one process it was an intermediate).
        self._mutated = frozenset(self.spec.mutated_inputs)
        self.device = device
        self.comm = comm if comm is not None else RankComm(p2p, device, pair_sends)
        self._owns_comm = comm is None
        local = set(local_stages) | {stage}
        self._recvs, self._sends = routes.recvs(stage), routes.sends(stage)
        self._remote_recvs = [t for t in self._recvs if t.src not in local]
        self._remote_grads = [t for t in self._sends if t.grad and t.dst not in local]
        # tensors whose shape travels ahead of them (Note [data-dependent messages])
        self._ragged = frozenset(
            t.tensor_id for t in self._recvs + self._sends if t.spec.data_dependent
        )
        self._local = local
        self._dtypes = {
            t.tensor_id: wire_dtype(boundary_dtype(t.spec.dtype), autocast)
            for t in self._recvs + self._sends
        }
        self._output_names = [o.name for o in self.spec.outputs]
        self._shapes: dict[tuple[Any, ...], tuple[int, ...]] = {}
        # each output's expected shape per (microbatch size, step sizes): None where it depends on the data
        self._wants: dict[tuple[Any, ...], list[tuple[int, ...] | None]] = {}
        # outputs a stage of another rank receives: a wrong shape is named from the receiver's side
        self._sent_away = frozenset(t.spec.name for t in self._sends if t.dst not in local)
        # the step's dynamic sizes besides the batch (Note [shape formulas]): set by whoever runs the step
        self.sizes: dict[str, int] = {}
        self._what = {
            g: {
                t.tensor_id: f"{'gradient of' if g else 'activation'} {t.spec.name!r}"
                for t in self._recvs + self._sends
            }
            for g in (False, True)
        }
        self._split = SplitBackward(
            [p for p in module.parameters() if p.requires_grad]
            if weight_params is None
            else weight_params
        )  # FSDP's whole parameters, not the module's shards
        self._states: dict[int, _Microbatch] = {}

    def __contains__(self, m: int) -> bool:
        """Whether microbatch ``m`` ran its forward here and awaits its backward."""
        return m in self._states

    def has_pending_weight(self, m: int) -> bool:
        """Whether ``B(m)`` ran split and ``W(m)`` is still to run."""
        state = self._states.get(m)
        return state is not None and state.weight is not None

    # -- receives, posted ahead ------------------------------------------------

    def _shape(self, t: Transfer, mb_size: int) -> tuple[int, ...]:
        """The receive buffer's shape: from the tensor's formula at the step's sizes (Note [shape formulas])."""
        key = (t.tensor_id, mb_size, *sorted(self.sizes.items()))
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = t.spec.shape_at(
                mb_size, self.manifest.microbatch_size, self.sizes
            )
        return shape

    def _post(self, transfers: list[Transfer], m: int, mb_size: int, gradient: bool) -> Pending:
        T = self.routes.num_tensors
        msgs, buffers, shapes = [], {}, {}
        for t in transfers:
            if t.tensor_id in self._ragged:  # Note [data-dependent messages]
                if not gradient:  # its shape now; its gradient's receive waits for B
                    shape = shapes[t.tensor_id] = self.comm.buffer(
                        (t.tensor_id, "shape"), (len(t.spec.shape),), torch.int64
                    )
                    msgs.append(
                        Message(
                            shape,
                            t.src,
                            t.tag(m, T, False, shape=True),
                            f"shape of {self._what[False][t.tensor_id]}",
                            m,
                        )
                    )
                continue
            buf = self.comm.buffer(
                (t.tensor_id, gradient), self._shape(t, mb_size), self._dtypes[t.tensor_id]
            )
            buffers[t.tensor_id] = buf
            msgs.append(
                Message(
                    buf,
                    t.dst if gradient else t.src,
                    t.tag(m, T, gradient),
                    self._what[gradient][t.tensor_id],
                    m,
                )
            )
        return Pending(self.comm.post_recvs(msgs), buffers, shapes)

    def _receive_ragged(
        self,
        transfers: Sequence[Transfer],
        m: int,
        gradient: bool,
        shapes: dict[int, tuple[int, ...]],
    ) -> dict[int, torch.Tensor]:
        """Receive data-dependent tensors (or their gradients) of the shapes ``shapes`` now (Note
        [data-dependent messages]), into buffers of their own."""
        T = self.routes.num_tensors
        msgs, got = [], {}
        for t in transfers:
            if t.tensor_id in shapes:
                buf = got[t.tensor_id] = torch.empty(
                    shapes[t.tensor_id], dtype=self._dtypes[t.tensor_id], device=self.device
                )
                peer = t.dst if gradient else t.src
                msgs.append(
                    Message(buf, peer, t.tag(m, T, gradient), self._what[gradient][t.tensor_id], m)
                )
        self.comm.wait(self.comm.post_recvs(msgs))
        return got

    def post_forward(self, m: int, mb_size: int) -> Pending:
        """Post the receives of ``F(m)`` (its activations from other ranks)."""
        return self._post(self._remote_recvs, m, mb_size, False)

    def post_backward(self, m: int, mb_size: int | None = None) -> Pending:
        """Post the receives of ``B(m)`` (its output gradients from other ranks)."""
        return self._post(
            self._remote_grads, m, self._states[m].mb_size if mb_size is None else mb_size, True
        )

    def receives(self, kind: str) -> bool:
        """Whether this stage's ``F`` (``kind="F"``) or ``B`` (``"B"``) receives from another rank."""
        return bool(
            self._remote_recvs if kind == "F" else self._remote_grads if kind == "B" else ()
        )

    # -- actions ---------------------------------------------------------------

    def forward(
        self, m: int, inputs: Sequence[torch.Tensor], mb_size: int, pending: Pending | None = None
    ) -> tuple[torch.Tensor, ...]:
        """``F(m)`` on the model inputs ``inputs`` (microbatch size ``mb_size``); this stage's outputs.

        Runs under the caller's grad mode (an evaluation step may run in ``no_grad``).
        """
        if pending is None:
            pending = self.post_forward(m, mb_size)
        state = self._states[m] = _Microbatch(mb_size)
        self.comm.wait(pending.posted)
        ragged = self._receive_ragged(
            self._remote_recvs,
            m,
            False,
            {i: tuple(int(n) for n in shape.tolist()) for i, shape in pending.shapes.items()},
        )
        for i, shape in pending.shapes.items():
            self.comm.release((i, "shape"), shape)
        for t in self._recvs:
            if t.tensor_id in ragged:
                buf = ragged[t.tensor_id]
            elif t.tensor_id in pending.buffers:
                buf = pending.buffers[t.tensor_id]
                state.pooled.append(((t.tensor_id, False), buf))
            else:
                buf = self.comm.take_local(t.tensor_id, m, False)
            value = buf.detach()
            state.received[t.spec.name] = value.requires_grad_(True) if t.grad else value
        by_name = dict(zip(self.routes.input_names, inputs))
        args = [
            self._fed(
                i.name,
                by_name[i.name].to(self.device) if i.producer == INPUT else state.received[i.name],
            )
            for i in self.spec.inputs
        ]
        if self.recompute and torch.is_grad_enabled():
            out = checkpointed(self.module, *args)  # Note [numpy under recomputation]
        else:
            out = self.module(*args)
        state.outputs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if len(state.outputs) != len(self._output_names):
            raise RuntimeSetupError(
                f"stage {self.stage} returned {len(state.outputs)} tensors but the manifest lists "
                f"{len(self._output_names)} outputs; the stage file and manifest disagree, "
                "rebuild the directory"
            )
        self._check_outputs(state.outputs, mb_size)
        mine = dict(zip(self._output_names, state.outputs))
        sends: list[Message] = []
        last: list[Message] = []  # data-dependent tensors, after their shapes and the rest
        for t in self._sends:
            value = mine[t.spec.name]
            if t.dst not in self._local and t.tensor_id in self._ragged:
                shape = torch.tensor(value.shape, dtype=torch.int64, device=self.device)
                tag = t.tag(m, self.routes.num_tensors, False, shape=True)
                what = f"shape of {self._what[False][t.tensor_id]}"
                sends.append(Message(shape, t.dst, tag, what, m))
            self._deliver(
                t,
                m,
                False,
                value.detach().to(self._dtypes[t.tensor_id]).contiguous(),
                last if t.tensor_id in self._ragged else sends,
            )
        sends += last
        _keep_sent(state, sends)
        self.comm.send(sends)
        return state.outputs

    def _check_outputs(self, outputs: Sequence[torch.Tensor], mb_size: int) -> None:
        """Refuse stage outputs whose shapes are not the manifest's at this microbatch size and the
        step's sizes (Note [shape formulas]), before any of them is sent or handed on: a stale build,
        or a dimension that depends on the data in a way the trace did not see. One check per output
        per microbatch (``BoundaryTensor.has_shape``), whatever receives it."""
        key = (mb_size, *sorted(self.sizes.items()))
        wants = self._wants.get(key)
        if wants is None:
            wants = self._wants[key] = [
                o.expected_shape(mb_size, self.manifest.microbatch_size, self.sizes)
                for o in self.spec.outputs
            ]
        traced = self.manifest.microbatch_size
        for o, value, want in zip(self.spec.outputs, outputs, wants):
            if not o.has_shape(value.shape, want, mb_size, traced, self.sizes):
                raise RuntimeSetupError(self._wrong_shape(o, tuple(value.shape), want, mb_size))

    def _wrong_shape(
        self, o: BoundaryTensor, shape: tuple[int, ...], want: tuple[int, ...] | None, mb_size: int
    ) -> str:
        """The one-line refusal of output ``o`` of shape ``shape``: from its receiver's side when a
        stage of another rank receives it, else from the manifest's."""
        at = "".join(f", {k} {v}" for k, v in self.sizes.items())
        if o.name in self._sent_away:
            return (
                f"stage {self.stage} output {o.name!r} has shape {shape} but its receiver expects "
                f"{tuple(o.dims or ()) if want is None else want} (formula {list(o.dims or o.shape)} "
                f"at microbatch size {mb_size}{at}); its shape depends on the data in a way the "
                "trace did not see, or the build is stale: keep that tensor inside one stage "
                "(--split-at) or rebuild the directory"
            )
        return (
            f"stage {self.stage} output {o.name!r} has shape {shape} but the manifest says "
            f"{list(o.dims or ()) if want is None else want} at microbatch size {mb_size}{at}; "
            "rebuild the directory"
        )

    def _fed(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """What the stage module gets for its input ``name``: a copy if the stage changes it in place."""
        return value.clone() if name in self._mutated else value

    def _deliver(
        self, t: Transfer, m: int, gradient: bool, tensor: torch.Tensor, sends: list[Message]
    ) -> None:
        """Hand ``tensor`` to a stage of this rank, or add its message to ``sends``."""
        peer = t.src if gradient else t.dst
        if peer in self._local:
            self.comm.put_local(t.tensor_id, m, gradient, tensor)
        else:
            sends.append(
                Message(
                    tensor,
                    peer,
                    t.tag(m, self.routes.num_tensors, gradient),
                    self._what[gradient][t.tensor_id],
                    m,
                )
            )

    def model_outputs(self, m: int) -> list[torch.Tensor]:
        """The flat model outputs of microbatch ``m``: this stage's and those received (on the last stage)."""
        state = self._states[m]
        mine = dict(zip(self._output_names, state.outputs))
        return [mine[n] if n in mine else state.received[n] for n in self.routes.model_outputs]

    def backward(
        self,
        m: int,
        tensors: Sequence[torch.Tensor] = (),
        grads: Sequence[torch.Tensor] = (),
        pending: Pending | None = None,
        split: bool = False,
    ) -> None:
        """``B(m)``: backpropagate the received output gradients plus ``tensors`` with ``grads``;
        with ``split``, input gradients only (``weight(m)`` does the rest)."""
        if pending is None:
            pending = self.post_backward(m)
        state = self._states[m]
        self.comm.wait(pending.posted)
        mine = dict(zip(self._output_names, state.outputs))
        ragged = self._receive_ragged(
            self._remote_grads,
            m,
            True,
            {
                t.tensor_id: tuple(mine[t.spec.name].shape)
                for t in self._remote_grads
                if t.tensor_id in self._ragged
            },
        )
        grads_in: dict[str, list[torch.Tensor]] = {}
        for t in self._sends:
            if not t.grad:
                continue
            if t.tensor_id in ragged:
                buf = ragged[t.tensor_id]
            elif t.tensor_id in pending.buffers:
                buf = pending.buffers[t.tensor_id]
                state.pooled.append(((t.tensor_id, True), buf))
            else:
                buf = self.comm.take_local(t.tensor_id, m, True)
            grads_in.setdefault(t.spec.name, []).append(buf)
        roots: list[torch.Tensor] = []
        root_grads: list[torch.Tensor] = []
        for name, value in zip(self._output_names, state.outputs):
            g = grads_in.get(name)
            if g and value.requires_grad:
                roots.append(value)
                summed = torch.stack(g).sum(0) if len(g) > 1 else g[0]
                root_grads.append(summed.to(value.dtype))  # the output may be in autocast's dtype
        roots += tensors
        root_grads += grads
        leaves = [state.received[t.spec.name] for t in self._recvs if t.grad]
        if split:
            got, state.weight = self._split.inputs(roots, root_grads, leaves)
            input_grads = dict(zip((t.spec.name for t in self._recvs if t.grad), got))
        else:
            if roots:
                torch.autograd.backward(roots, root_grads)
            input_grads = {
                t.spec.name: state.received[t.spec.name].grad for t in self._recvs if t.grad
            }
        sends: list[Message] = []
        last: list[Message] = []  # Note [data-dependent messages]
        for t in self._recvs:
            if t.grad:
                grad = input_grads.get(t.spec.name)
                self._deliver(
                    t,
                    m,
                    True,
                    grad if grad is not None else torch.zeros_like(state.received[t.spec.name]),
                    last if t.tensor_id in self._ragged else sends,
                )
        sends += last
        _keep_sent(state, sends)
        self.comm.send(sends)
        if not split:
            self._done(m)

    def weight(self, m: int) -> None:
        """``W(m)``: the weight gradients a split ``B(m)`` left, added to ``.grad``."""
        state = self._states[m]
        if state.weight is None:
            raise RuntimeSetupError(
                f"W of stage {self.stage} microbatch {m} runs before its split B; the schedule "
                "must run B before W"
            )
        self._split.weights(state.weight)
        self._done(m)

    def discard(self, m: int) -> None:
        """Forget microbatch ``m`` without a backward (it ran forward only, e.g. an evaluation step)."""
        if m in self._states:
            self._done(m)

    def finish_step(self) -> None:
        """Post the last sends and wait for every send of the step (a worker with its own comm)."""
        self.comm.finish()

    def _done(self, m: int) -> None:
        """Microbatch ``m`` needs nothing more here: give its receive buffers back."""
        state = self._states.pop(m)
        for key, buf in state.pooled:
            self.comm.release(key, buf)


def _keep_sent(state: _Microbatch, sends: list[Message]) -> None:
    """A buffer that a posted send reads from (a stage that passes a received tensor on, or a
    gradient flowing through unchanged) is not given back to the pool: the send may be in
    flight until the step ends, so that buffer must not receive anything else."""
    if not sends or not state.pooled:
        return
    sent = {m.tensor.untyped_storage().data_ptr() for m in sends}
    state.pooled = [(k, b) for k, b in state.pooled if b.untyped_storage().data_ptr() not in sent]
