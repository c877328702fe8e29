"""A character-level language model trained on the project's own README.md (bytes, vocabulary 256).

The model file of a real training run: besides ``build_model`` / ``example_inputs`` /
``example_targets`` / ``loss_fn`` it defines ``train_batches`` and ``eval_batches``, which
``fxpipe run`` draws its batches from (``fxpipe.runtime.train.data_iter``). Each replica reads its
own random windows of the first 90% of the text (seeded by ``rank_info.replica``); eval
uses fixed windows of the last 10%. A rank that does not read the model inputs (or the
targets) skips building them::

    fxpipe partition examples/charlm.py --stages 2 --batch-size 16 --microbatches 4 --out build/charlm
    fxpipe run build/charlm --steps 200 --optimizer adamw --lr 3e-3 --warmup-steps 20 \
        --lr-schedule cosine --clip-grad-norm 1.0 --eval-every 50 --log-every 20
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

TEXT = Path(__file__).resolve().parents[1] / "README.md"
VOCAB, BLOCK, WIDTH, HEADS, LAYERS = 256, 32, 64, 4, 2


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.out = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, t, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class CharLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.zeros(1, BLOCK, WIDTH))
        self.blocks = nn.Sequential(*(Block() for _ in range(LAYERS)))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(self.blocks(self.embed(idx) + self.pos)))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return CharLM()


def _text() -> torch.Tensor:
    return torch.frombuffer(bytearray(TEXT.read_bytes()), dtype=torch.uint8).long()


def _windows(data: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = starts[:, None] + torch.arange(BLOCK + 1)
    chunk = data[rows]
    return chunk[:, :-1], chunk[:, 1:]


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (_windows(_text(), torch.arange(batch_size) * BLOCK)[0],)


def example_targets(batch_size: int) -> torch.Tensor:
    return _windows(_text(), torch.arange(batch_size) * BLOCK)[1]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _batches(
    data: torch.Tensor, batch_size: int, rank_info: Any, g: torch.Generator, count: int | None
) -> Iterator[tuple[Any, Any]]:
    n = 0
    while count is None or n < count:
        starts = torch.randint(
            0, len(data) - BLOCK - 1, (batch_size,), generator=g
        )  # drawn on every rank
        x, y = _windows(data, starts)
        yield (x if rank_info.needs_inputs else None), (y if rank_info.needs_targets else None)
        n += 1


def train_batches(batch_size: int, rank_info: Any) -> Iterator[tuple[Any, Any]]:
    """Endless random windows of the first 90% of the text; each replica its own stream."""
    data = _text()
    g = torch.Generator().manual_seed(1000 + rank_info.replica)
    return _batches(data[: int(0.9 * len(data))], batch_size, rank_info, g, None)


def eval_batches(batch_size: int, rank_info: Any) -> Iterator[tuple[Any, Any]]:
    """Fixed windows of the held-out last 10% of the text."""
    data = _text()
    g = torch.Generator().manual_seed(7 + rank_info.replica)
    return _batches(data[int(0.9 * len(data)) :], batch_size, rank_info, g, 8)
