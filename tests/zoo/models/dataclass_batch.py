"""A detection-style model called with a dataclass batch holding a list of feature maps:
``model(batch)`` with ``batch = Batch(pixels=..., features=[f1, f2], scale=2.0)``, as a
training framework's collate function hands one over. A convolutional stem over ``pixels``, each
extra feature map through its own 1x1 convolution, summed into one head; BatchNorm in the stem,
so the modes differ. Dataclasses are flattened field by field at the model's boundary (Note
[tensors inside containers] in ``fxpipe.model_inputs``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))  # for _zoo.py next to this file

import _zoo  # noqa: E402
from _zoo import class_loss as loss_fn, class_targets as example_targets  # noqa: E402,F401

DROPOUT = False
KWARGS_ONLY = False


@dataclass
class Batch:
    pixels: torch.Tensor
    features: list[torch.Tensor] = field(default_factory=list)
    scale: float = 1.0


class Stem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(_zoo.CHANNELS, 16, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.relu(self.bn(self.conv(x))))


class FeatureNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = Stem()
        self.lateral = nn.ModuleList([nn.Conv2d(4, 16, 1), nn.Conv2d(6, 16, 1)])
        self.head = nn.Linear(16, _zoo.CLASSES)

    def forward(self, batch: Batch) -> torch.Tensor:
        x = self.stem(batch.pixels)
        for conv, f in zip(self.lateral, batch.features):
            x = x + conv(f)
        return self.head(torch.relu(x).mean((2, 3))) * batch.scale


def build_model() -> nn.Module:
    return _zoo.seeded(0, FeatureNet)


def example_inputs(batch_size: int) -> tuple[Batch]:
    g = torch.Generator().manual_seed(3)
    size = _zoo.IMAGE // 4
    return (
        Batch(
            pixels=_zoo.images(batch_size),
            features=[
                torch.randn(batch_size, 4, size, size, generator=g),
                torch.randn(batch_size, 6, size, size, generator=g),
            ],
            scale=2.0,
        ),
    )
