"""A two-input model whose units form a branch/merge DAG, not a chain.

``x`` and ``y`` are encoded separately, ``x`` feeds two parallel branches, the
branches merge, the merged value meets the ``y`` encoding, and a skip connection
from the ``x`` encoder reaches the head.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

X_FEATURES = 16
Y_FEATURES = 8
HIDDEN = 32
OUT = 4


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc_x = nn.Sequential(nn.Linear(X_FEATURES, HIDDEN), nn.Tanh())
        self.enc_y = nn.Sequential(nn.Linear(Y_FEATURES, HIDDEN), nn.ReLU())
        self.left = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN))
        self.right = nn.Sequential(
            nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN)
        )
        self.merge = nn.Linear(2 * HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hx = self.enc_x(x)
        hy = self.enc_y(y)
        merged = self.merge(torch.cat([self.left(hx), self.right(hx)], dim=-1))
        return self.head(merged * hy + hx)


def build_model() -> nn.Module:
    return Branchy()


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return (
        torch.randn(batch_size, X_FEATURES, generator=g),
        torch.randn(batch_size, Y_FEATURES, generator=g),
    )


def example_targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randn(batch_size, OUT, generator=g)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)
