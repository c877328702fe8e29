"""A tiny ResNet-style CNN: convolutions, BatchNorm and residual adds."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

CHANNELS = 3
SIZE = 16
CLASSES = 10


class BasicBlock(nn.Module):
    """Two 3x3 conv+BN layers with an identity (or 1x1 projection) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """Stem, three stages of two blocks each (8, 16, 32 channels), pooling, classifier."""

    def __init__(self, classes: int = CLASSES, widths: tuple[int, ...] = (8, 16, 32)) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(CHANNELS, widths[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(),
        )
        blocks: list[nn.Module] = []
        cin = widths[0]
        for i, w in enumerate(widths):
            blocks += [BasicBlock(cin, w, stride=1 if i == 0 else 2), BasicBlock(w, w)]
            cin = w
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def build_model() -> nn.Module:
    return ResNet()


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch_size, CHANNELS, SIZE, SIZE, generator=g),)


def example_targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)
