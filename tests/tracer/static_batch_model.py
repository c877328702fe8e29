"""A model file whose forward fixes the batch size (CLIP's way: ``torch.arange(len(logits))`` as targets)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Contrastive(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 8))
        self.text = nn.Sequential(nn.Embedding(20, 16), nn.Linear(16, 8))

    def forward(self, pixels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        a = F.normalize(self.image(pixels), dim=-1)
        b = F.normalize(self.text(ids).mean(1), dim=-1)
        logits = a @ b.t() * 10.0
        return F.cross_entropy(logits, torch.arange(len(logits)))  # the batch becomes a constant


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Contrastive()


def example_inputs(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(batch_size, 6, generator=gen), torch.randint(
        0, 20, (batch_size, 5), generator=gen
    )
