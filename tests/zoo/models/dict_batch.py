"""A two-tower model called with one dict batch, as vision and multimodal code calls its models:
``model(batch)`` with ``batch = {"image": ..., "tokens": ..., "temperature": 0.5}`` (a plain
constant among the tensors), returning a dict. An image tower (two convolutions), a text tower
(embedding and a GRU-free mean of two linear layers) and a fused head. The dict is flattened at the
model's boundary (Note [tensors inside containers] in ``fxpipe.model_inputs``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))  # for _zoo.py next to this file

import _zoo  # noqa: E402
from _zoo import class_targets as example_targets  # noqa: E402,F401

DROPOUT = False
KWARGS_ONLY = False
WIDTH = 32


class ImageTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(_zoo.CHANNELS, 8, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.proj = nn.Linear(16, WIDTH)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv2(torch.relu(self.conv1(image))))
        return self.proj(x.mean((2, 3)))


class TextTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(_zoo.VOCAB, WIDTH)
        self.fc1 = nn.Linear(WIDTH, WIDTH)
        self.fc2 = nn.Linear(WIDTH, WIDTH)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return self.fc2(torch.tanh(self.fc1(x))).mean(1)


class TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image = ImageTower()
        self.text = TextTower()
        self.fuse = nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, _zoo.CLASSES)

    def forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        img = self.image(batch["image"])
        txt = self.text(batch["tokens"])
        h = torch.relu(self.fuse(torch.cat([img, txt], -1)))
        return {"logits": self.head(h) / batch["temperature"], "similarity": (img * txt).sum(-1)}


def build_model() -> nn.Module:
    return _zoo.seeded(0, TwoTower)


def example_inputs(batch_size: int) -> tuple[dict[str, Any]]:
    return (
        {
            "image": _zoo.images(batch_size),
            "tokens": _zoo.token_ids(batch_size, seq=8),
            "temperature": 0.5,
        },
    )


def loss_fn(output: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return (
        nn.functional.cross_entropy(output["logits"], target) + output["similarity"].pow(2).mean()
    )
