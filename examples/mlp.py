"""A plain multilayer perceptron: the simplest chain of units."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

IN_FEATURES = 32
HIDDEN = 64
LAYERS = 4
CLASSES = 10


class MLP(nn.Module):
    """``LAYERS`` hidden Linear+ReLU layers and a classifier head."""

    def __init__(
        self,
        in_features: int = IN_FEATURES,
        hidden: int = HIDDEN,
        layers: int = LAYERS,
        classes: int = CLASSES,
    ) -> None:
        super().__init__()
        dims = [in_features] + [hidden] * layers
        self.layers = nn.Sequential(
            *(nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(dims[:-1], dims[1:]))
        )
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


def build_model() -> nn.Module:
    return MLP()


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch_size, IN_FEATURES, generator=g),)


def example_targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)
