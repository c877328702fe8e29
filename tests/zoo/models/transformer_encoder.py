"""A token classifier built on ``nn.TransformerEncoder`` (4 ``nn.TransformerEncoderLayer``s,
``batch_first=True``, GELU, dropout 0.1, a final LayerNorm) with a ``src_key_padding_mask``,
a learned position embedding and a per-token head: the way PyTorch tutorials and many research
codebases write a transformer. Inputs: token ids and an attention mask (1 = keep).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))  # for _zoo.py next to this file

import _zoo  # noqa: E402
from _zoo import lm_inputs as example_inputs, mlm_targets as example_targets, token_loss as loss_fn  # noqa: E402,F401

DROPOUT = True
KWARGS_ONLY = False


class EncoderClassifier(nn.Module):
    def __init__(
        self,
        vocab: int,
        width: int = 32,
        heads: int = 4,
        layers: int = 4,
        max_len: int = 64,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(1, max_len, width) * 0.02)
        layer = nn.TransformerEncoderLayer(
            width,
            heads,
            dim_feedforward=2 * width,
            dropout=dropout,
            activation="gelu",
            batch_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(width))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[:, : ids.shape[1]]
        x = self.encoder(x, src_key_padding_mask=attention_mask == 0)
        return self.head(x)


def build_model() -> nn.Module:
    return _zoo.seeded(0, lambda: EncoderClassifier(_zoo.VOCAB))
