"""The data-parallel oracle: one process training the whole model on the replicas' batches concatenated."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn


def train_on_concatenated_batches(
    model: nn.Module,
    batch: Callable[[int, int], tuple[Any, torch.Tensor]],
    steps: int,
    replicas: int,
    microbatches: int,
    loss_fn: Callable[..., torch.Tensor],
    optimizer: Callable[[Any], torch.optim.Optimizer],
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` steps of ``optimizer`` on ``batch(step, replica)`` of every replica concatenated, cut
    into ``replicas x microbatches`` chunks whose gradients are averaged; the per-step mean chunk
    loss and the final state dict. ``batch`` returns ``(input, target)``; a 1-tuple input is unpacked."""
    model.train()
    opt = optimizer(model.parameters())
    chunks, losses = replicas * microbatches, []
    for k in range(steps):
        opt.zero_grad()
        parts = [batch(k, r) for r in range(replicas)]
        inputs = [p[0][0] if isinstance(p[0], tuple) else p[0] for p in parts]
        x, y = torch.cat(inputs), torch.cat([p[1] for p in parts])
        total = 0.0
        for xc, yc in zip(x.chunk(chunks), y.chunk(chunks)):
            loss = loss_fn(model(xc), yc)
            (loss / chunks).backward()
            total += loss.item()
        losses.append(total / chunks)
        opt.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
