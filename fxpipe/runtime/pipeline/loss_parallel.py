"""The loss over vocabulary-sharded logits: torch's ``loss_parallel`` where it is exact, else gathered.

A tensor-parallel LM head leaves its logits sharded over the vocabulary (Note
[vocabulary-parallel] in ``fxpipe.codegen.tp_plan``). torch's ``loss_parallel()`` computes a cross
entropy of such logits without gathering them: while it is on, DTensor's ``_log_softmax`` and
``nll_loss_forward`` all-reduce the row maxima, sums and picked logits over the tp group, and the
backward of the pair is fused (``_log_softmax_backward_data`` passes its gradient through). That
fusion is exact only when the log-softmax of the logits feeds ``nll_loss`` and nothing else.

Note [which losses run in parallel]:
``VocabParallelLoss`` runs the user's ``loss_fn`` once on meta copies of its arguments, under a
dispatch mode that follows the tensors derived from the sharded logits, before the first real
call: casts, views and slices that keep the vocabulary as the last dimension, then
``_log_softmax`` over it, whose result feeds only ``nll_loss_forward`` (``F.cross_entropy`` with
no label smoothing, any reduction, weights and ``ignore_index``). Such a loss is called on the
sharded logits (the runner holds ``loss_parallel()`` over the step, forward and backward); any
other (a label-smoothed or soft-target cross entropy, a mean squared error, a loss that fails on
meta tensors) is called on the logits gathered whole, as without tensor parallelism, and the
reason is warned once. The model's own loss (``labels=``) needs no probe: the stage computed it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fxpipe.runtime.pipeline.loss import model_loss

__all__ = ["VocabParallelLoss", "cross_entropy_only", "loss_parallel", "sharded_logits"]

aten = torch.ops.aten
# ops that keep a tensor of the logits a tensor of the logits (the vocabulary still last)
_KEEPS = {
    aten.view,
    aten._unsafe_view,
    aten.reshape,
    aten._to_copy,
    aten.clone,
    aten.alias,
    aten.detach,
    aten.contiguous,
    aten.slice,
    aten.select,
}


def _leaves(tree: Any) -> list[Any]:
    leaves = pytree.tree_leaves(tree)
    if len(leaves) == 1 and isinstance(tree, Mapping):  # a mapping pytree does not open
        leaves = list(tree.values())
    return leaves


def sharded_logits(output: Any) -> list[DTensor]:
    """The DTensors of ``output`` sharded over their last dimension (a vocabulary-parallel head's
    logits)."""
    return [
        x
        for x in _leaves(output)
        if isinstance(x, DTensor)
        and any(isinstance(p, Shard) and p.dim in (-1, x.dim() - 1) for p in x.placements)
    ]


class _Follow(TorchDispatchMode):
    """Follows the tensors derived from ``logits`` through one loss (Note [which losses run in
    parallel]); ``why`` is the first reason the loss cannot run on sharded logits."""

    def __init__(self, logits: list[torch.Tensor], vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.derived: dict[int, torch.Tensor] = {id(t): t for t in logits}
        self.log_softmax: dict[int, torch.Tensor] = {}
        self.why = ""

    @staticmethod
    def _last(args: Any) -> bool:
        """A slice or select (``args``: tensor, dim, ...) of the last dimension."""
        dim = args[1] if len(args) > 1 else 0
        return args[0].dim() > 0 and dim % args[0].dim() == args[0].dim() - 1

    def _keeps(self, packet: Any, args: Any, outs: list[torch.Tensor]) -> bool:
        """An op whose results still hold whole rows of the vocabulary, last."""
        if packet not in _KEEPS or (packet in (aten.slice, aten.select) and self._last(args)):
            return False
        return all(t.dim() and t.shape[-1] == self.vocab for t in outs)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        derived = [t for t in ins if id(t) in self.derived]
        softmaxed = [t for t in ins if id(t) in self.log_softmax]
        packet, name = func.overloadpacket, func.overloadpacket.__name__
        if packet is aten.nll_loss_forward and softmaxed:
            if args[0] is not softmaxed[0] or len(softmaxed) > 1 or derived or args[0].dim() > 2:
                self.why = self.why or "nll_loss of more than one log_softmax of the logits"
        elif softmaxed and self._keeps(packet, args, outs):  # a view of the log-probabilities
            self.log_softmax.update((id(t), t) for t in outs)
        elif softmaxed:
            self.why = self.why or f"the log_softmax of the logits feeds {name}"
        elif not derived:
            pass
        elif packet is aten._log_softmax:
            x = args[0]
            if x.dim() and args[1] % x.dim() != x.dim() - 1:
                self.why = self.why or "a log_softmax over another dimension than the vocabulary"
            self.log_softmax.update((id(t), t) for t in outs)
        elif packet in (aten.slice, aten.select) and self._last(args):
            self.why = self.why or f"{name} of the vocabulary dimension"
        elif self._keeps(packet, args, outs):
            self.derived.update((id(t), t) for t in outs)
        else:
            self.why = self.why or f"{name} on the logits"
        return out


def cross_entropy_only(
    loss_fn: Callable[..., Any], output: Any, target: Any, logits: list[torch.Tensor] | None = None
) -> str:
    """Why ``loss_fn(output, target)`` is not exact on vocabulary-sharded logits under
    ``loss_parallel()`` ("" when it is: Note [which losses run in parallel]). ``logits``: the
    tensors of ``output`` sharded over their last dimension (by default its DTensors sharded so)."""
    if logits is None:
        logits = list(sharded_logits(output))
    if not logits:
        return ""
    copies: dict[int, torch.Tensor] = {}

    def meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            copies[id(x)] = torch.empty(x.shape, dtype=x.dtype, device="meta")
            return copies[id(x)]
        return x

    try:
        meta_output = pytree.tree_map(meta, output)
        meta_target = pytree.tree_map(meta, target)
    except (TypeError, ValueError) as exc:
        return f"its output could not be copied ({type(exc).__name__})"
    follow = _Follow([copies[id(t)] for t in logits], logits[0].shape[-1])
    try:
        with torch.no_grad(), follow:
            loss_fn(meta_output, meta_target)
    except Exception as exc:  # any failure: the loss runs on gathered logits, as ever
        return f"it failed on meta tensors ({type(exc).__name__})"
    if not follow.why and not follow.log_softmax:
        return "it takes no log_softmax of the logits"
    return follow.why


def _gathered(x: Any) -> Any:
    return x.full_tensor() if isinstance(x, DTensor) else x


class VocabParallelLoss:
    """``loss_fn`` on the loss stage of a vocabulary-parallel head: on the sharded logits under the
    runner's ``loss_parallel()`` when that is exact, else on the logits gathered whole (Note
    [which losses run in parallel]); the loss a plain tensor either way. ``parallel`` is None
    before the first call, then whether the logits stayed sharded; ``why`` says why not."""

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        self.loss_fn = loss_fn
        self.parallel: bool | None = None
        self.why = ""

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        if self.parallel is None and sharded_logits(output):
            own = self.loss_fn is model_loss
            self.why = "" if own else cross_entropy_only(self.loss_fn, output, target)
            self.parallel = not self.why
            if self.why:
                warnings.warn(
                    f"fxpipe: tensor parallelism: the loss_fn is not a cross entropy that "
                    f"loss_parallel computes exactly ({self.why}); its logits are gathered whole",
                    stacklevel=2,
                )
        if self.parallel is False:
            output = pytree.tree_map(_gathered, output)
        loss = self.loss_fn(output, target)
        return loss.full_tensor() if isinstance(loss, DTensor) else loss
