"""A mid-sized GPT (examples/gpt.py's architecture, wider and deeper) for the runtime benchmark."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402

VOCAB, BLOCK, WIDTH, HEADS, LAYERS = 512, 64, 128, 4, 6


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return gpt.GPT(vocab=VOCAB, block=BLOCK, width=WIDTH, heads=HEADS, layers=LAYERS)


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return gpt.example_inputs(batch_size, VOCAB, BLOCK)


def example_targets(batch_size: int) -> torch.Tensor:
    return gpt.example_targets(batch_size, VOCAB, BLOCK)


loss_fn = gpt.loss_fn
