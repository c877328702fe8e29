"""Fake (shape-only) kernels that torch lacks for aten operators models call, so ``torch.export`` can trace them.

``torch.export`` runs the model on fake tensors, and an operator whose output shape depends on
tensor values needs a fake kernel that makes that size a new symbol. torch 2.13 has none for
``aten::_ctc_loss.Tensor`` (CTC loss with lengths given as tensors, what transformers' CTC heads
call: Wav2Vec2, HuBERT, ...): it stops with ``DynamicOutputShapeException: aten._ctc_loss.Tensor``.
Its outputs are the per-sample loss ``[B]`` and the forward variables ``log_alpha`` ``[B, T,
2 * max(target_lengths) + 1]`` (ATen's ``ctc_loss_cpu_template``); the last size is a new
unbacked symbol. Registered once, on first use (:func:`register_fake_kernels`), only where torch
has none; the real kernels are untouched.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import torch

__all__ = ["register_fake_kernels"]


def _ctc_loss_fake(
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    input_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int = 0,
    zero_infinity: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    batched = log_probs.dim() == 3
    time, batch = log_probs.shape[0], (log_probs.shape[1] if batched else 1)
    ctx = torch.library.get_ctx()
    shape_env = getattr(ctx, "_shape_env", None)
    # log_alpha is saved for the backward and never read by the forward's graph: its size symbol
    # need not reach the graph (a composite ctc_loss returns only the reduced loss)
    with shape_env.ignore_fresh_unbacked_symbols() if shape_env is not None else nullcontext():
        longest = ctx.new_dynamic_size()
    loss = log_probs.new_empty((batch,) if batched else ())
    log_alpha = log_probs.new_empty((batch, time, 2 * longest + 1))
    return loss, log_alpha


@functools.cache
def register_fake_kernels() -> None:
    """Register the fake kernels of this module where torch has none (once per process)."""
    from torch._library.simple_registry import singleton

    name = "aten::_ctc_loss.Tensor"
    if singleton.find(name).fake_impl.kernel is None:
        torch.library.register_fake(name, _ctc_loss_fake)
