"""A model file whose stage boundary carries a tensor with a data-dependent shape: the tokens a
mask keeps, packed (``h[mask]``: ``[kept, WIDTH]``), run through an MLP and scattered back. Each
microbatch keeps another number of tokens; ``--split-at mlp_in`` puts the packed tensor on the
boundary. The example's mask keeps 3 tokens per sample, so the traced sizes alone would pass for
the formula ``3*mb`` (Note [data-dependent shapes])."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH, LENGTH = 8, 6


class Packed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.mlp_in = nn.Linear(WIDTH, 2 * WIDTH)
        self.mlp_out = nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        packed = h[mask]  # [kept tokens, WIDTH]: depends on the mask's values
        y = self.mlp_out(torch.tanh(self.mlp_in(packed)))
        return self.head(h + torch.zeros_like(h).masked_scatter(mask.unsqueeze(-1), y))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Packed()


def _batch(batch_size: int, seed: int, keep: float | None = None) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, LENGTH, WIDTH, generator=g)
    if keep is None:  # the example: the first 3 tokens of every sample
        mask = (torch.arange(LENGTH) < 3).expand(batch_size, LENGTH).contiguous()
    else:
        mask = torch.rand(batch_size, LENGTH, generator=g) < keep
    y = torch.randn(batch_size, LENGTH, WIDTH, generator=g)
    return x, mask, y


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return _batch(batch_size, 0)[:2]


def example_targets(batch_size: int) -> torch.Tensor:
    return _batch(batch_size, 0)[2]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def train_batches(batch_size: int, rank_info: Any) -> Iterator[tuple[Any, Any]]:
    step = 0
    while True:  # another share of kept tokens every step, so every microbatch packs another count
        x, mask, y = _batch(batch_size, 100 * rank_info.replica + step, (0.3, 0.7, 0.5)[step % 3])
        yield ((x, mask) if rank_info.needs_inputs else None), y
        step += 1
