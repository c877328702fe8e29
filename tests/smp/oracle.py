"""One-process oracles for the seed scripts: the same model, optimizer and microbatching."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn


def train_one_process(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    microbatches: int,
    loss_fn: Callable[[Any, Any], torch.Tensor],
) -> list[float]:
    """Per batch: zero grads, accumulate each equal microbatch's loss / M, step. Returns the mean losses."""
    model.train()
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        total = []
        for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches)):
            loss = loss_fn(model(xm), ym)
            (loss / microbatches).backward()
            total.append(loss.detach())
        optimizer.step()
        losses.append(torch.stack(total).mean().item())
    return losses
