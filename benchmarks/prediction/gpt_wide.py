"""A GPT wide enough to keep one GPU busy (examples/gpt.py's architecture): the one-GPU prediction benchmark's
compute-bound model, beside the launch-bound tiny ones."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402

VOCAB, BLOCK, WIDTH, HEADS, LAYERS = 4096, 256, 1024, 16, 8


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return gpt.GPT(vocab=VOCAB, block=BLOCK, width=WIDTH, heads=HEADS, layers=LAYERS)


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return gpt.example_inputs(batch_size, VOCAB, BLOCK)


def example_targets(batch_size: int) -> torch.Tensor:
    return gpt.example_targets(batch_size, VOCAB, BLOCK)


loss_fn = gpt.loss_fn
