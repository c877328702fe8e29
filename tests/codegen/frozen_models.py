"""Model files of tests/codegen/test_frozen.py: parameters frozen in every way a model freezes them (issue 37).

``build_model`` freezes an embedding (a torch.nn layer), a Linear inside a user block, a parameter the
model creates directly, and one of two norms in a block that is otherwise trainable; the head stays trainable.
"""

from __future__ import annotations

import torch
import torch.nn as nn

VOCAB, WIDTH, SEQ = 24, 16, 6


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.scale = nn.Parameter(torch.full((width,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x))) * self.scale


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.offset = nn.Parameter(torch.randn(WIDTH))
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(4))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.offset
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    model = Frozen()
    model.embed.requires_grad_(False)
    model.offset.requires_grad_(False)
    model.blocks[0].requires_grad_(False)
    model.blocks[3].fc.requires_grad_(False)
    model.blocks[3].scale.requires_grad_(False)
    return model


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (batch_size, SEQ), generator=torch.Generator().manual_seed(1)),)


def example_targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=torch.Generator().manual_seed(2))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))
