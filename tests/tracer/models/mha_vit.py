"""A ViT encoder block written as torchvision writes it: ``nn.MultiheadAttention(batch_first=True,
dropout=...)`` called as ``self_attention(x, x, x, need_weights=False)``, and ``torch._assert`` with an
f-string message on a traced shape."""

import torch
import torch.nn as nn


class EncoderBlock(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(width, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        torch._assert(
            input.dim() == 3, f"Expected (batch_size, seq_length, hidden_dim) got {input.shape}"
        )
        x = self.ln_1(input)
        x, _ = self.self_attention(x, x, x, need_weights=False)
        x = self.dropout(x) + input
        return x + self.mlp(self.ln_2(x))


class Encoder(nn.Module):
    def __init__(
        self, seq: int = 6, width: int = 16, heads: int = 4, layers: int = 3, dropout: float = 0.1
    ) -> None:
        super().__init__()
        self.seq = seq
        self.pos = nn.Parameter(torch.randn(1, seq, width) * 0.02)
        self.blocks = nn.Sequential(*[EncoderBlock(width, heads, dropout) for _ in range(layers)])
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, s, w = x.shape
        torch._assert(s == self.seq, f"Wrong sequence length! Expected {self.seq} but got {s}!")
        return self.head(self.blocks(x + self.pos))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Encoder()


def build_without_dropout() -> nn.Module:
    torch.manual_seed(0)
    return Encoder(dropout=0.0)


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch_size, 6, 16, generator=torch.Generator().manual_seed(1)),)
