"""A small MLP with dropout after each hidden layer: the RNG streams decide every step's masks
(tests/runtime/test_dcp_checkpoint.py resumes it bit for bit)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

IN_FEATURES, HIDDEN, CLASSES = 32, 64, 10


def build_model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in [(IN_FEATURES, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, HIDDEN)]:
        layers += [nn.Linear(a, b), nn.ReLU(), nn.Dropout(0.3)]
    return nn.Sequential(*layers, nn.Linear(HIDDEN, CLASSES))


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch_size, IN_FEATURES, generator=g),)


def example_targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)
