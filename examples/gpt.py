"""A tiny GPT-style decoder written the ordinary way (nanoGPT style).

It exercises what makes real models hard to trace: the attention slices a registered
causal-mask buffer by ``x.shape`` (so ``torch.fx.symbolic_trace`` cannot trace it and
fxpipe keeps it whole as a leaf), the input and output embeddings are tied
(``lm_head.weight is wte.weight``), and the position embedding is a bare
``nn.Parameter`` read with a slice.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 64
BLOCK = 16
WIDTH = 32
HEADS = 4
LAYERS = 4


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with an explicit mask buffer."""

    def __init__(self, width: int, heads: int, block: int) -> None:
        super().__init__()
        assert width % heads == 0
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        mask = torch.tril(torch.ones(block, block)).view(1, 1, block, block)
        self.register_buffer("mask", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()  # shape arithmetic: symbolic tracing cannot follow this
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, block: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, block)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer returning logits of shape (batch, seq, vocab)."""

    def __init__(
        self,
        vocab: int = VOCAB,
        block: int = BLOCK,
        width: int = WIDTH,
        heads: int = HEADS,
        layers: int = LAYERS,
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Parameter(torch.randn(1, block, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads, block) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied input/output embeddings
        nn.init.normal_(self.wte.weight, std=0.02)  # GPT-2's init: logits start near uniform

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        x = self.wte(idx) + self.wpe[:, :t]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model() -> nn.Module:
    return GPT()


def example_inputs(
    batch_size: int, vocab: int = VOCAB, block: int = BLOCK
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, vocab, (batch_size, block), generator=g),)


def example_targets(batch_size: int, vocab: int = VOCAB, block: int = BLOCK) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, vocab, (batch_size, block), generator=g)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.size(-1)), target.reshape(-1))
