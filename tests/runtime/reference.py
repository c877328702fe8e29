"""The oracle: one-process training of the original model with the same microbatching."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.nn as nn


def reference_train(
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    targets: torch.Tensor,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    steps: int,
    microbatches: int,
    lr: float,
    average: bool = True,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """SGD for ``steps`` steps; each step accumulates the gradients of ``microbatches``
    equal chunks (averaged or summed); returns the per-step mean microbatch loss and
    the final state dict."""
    model = copy.deepcopy(model).train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    chunks = list(zip(*(x.chunk(microbatches) for x in inputs)))
    target_chunks = targets.chunk(microbatches)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for mb, tgt in zip(chunks, target_chunks):
            loss = loss_fn(model(*mb), tgt)
            (loss / microbatches if average else loss).backward()
            total += loss.item()
        opt.step()
        losses.append(total / microbatches)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
