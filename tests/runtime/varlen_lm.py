"""A model file whose batches change their sequence length every step: a tiny decoder LM with tied
embeddings, a learned position table (so lengths up to ``BLOCK`` hold) and ``dynamic_dims()``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, BLOCK, WIDTH, HEADS, LAYERS = 32, 24, 16, 2, 4
LENGTHS = (8, 12, 5, 16, 9, 24)  # one per step, then again


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.fc = nn.Linear(WIDTH, 2 * WIDTH)
        self.out = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, t, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(x)))


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(1, BLOCK, WIDTH) * 0.02)
        self.blocks = nn.Sequential(*(Block() for _ in range(LAYERS)))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos[:, : idx.size(1)]
        return self.head(self.ln_f(self.blocks(x)))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return TiedLM()


def dynamic_dims() -> dict[str, Any]:
    return {"idx": {1: ("seq", 2, BLOCK)}}


def _batch(batch_size: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, VOCAB, (batch_size, length + 1), generator=g)
    return rows[:, :-1], rows[:, 1:]


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (_batch(batch_size, 12, 0)[0],)


def example_targets(batch_size: int) -> torch.Tensor:
    return _batch(batch_size, 12, 0)[1]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def train_batches(batch_size: int, rank_info: Any) -> Iterator[tuple[Any, Any]]:
    step = 0
    while True:
        x, y = _batch(batch_size, LENGTHS[step % len(LENGTHS)], 100 * rank_info.replica + step)
        yield (x if rank_info.needs_inputs else None), y
        step += 1
