"""A Llama-shaped decoder written by hand, at four sizes: a model file for the scale benchmark.

RMSNorm, rotary position embeddings (cos/sin tables as non-persistent buffers, so a checkpoint
does not hold them), grouped-query attention through ``scaled_dot_product_attention``, a SwiGLU
MLP, and an untied ``lm_head``. Parameters are created with ``torch.empty`` and initialised by
``reset_parameters``, so a meta build (``fxpipe ... --device meta``) touches no memory for them.

Pick a size with the factory: ``llama.py:build_125m``, ``build_1b``, ``build_7b``, ``build_70b``
(the last: Llama-3-70B's shape, 80 layers, width 8192, 64 heads, 8 KV heads, FFN 28672, vocab 128256).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

SEQ = 256


@dataclass(frozen=True)
class LlamaShape:
    vocab: int
    width: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int


SHAPES = {
    "125m": LlamaShape(vocab=32000, width=768, layers=12, heads=12, kv_heads=12, ffn=2048),
    "1b": LlamaShape(vocab=32000, width=2048, layers=22, heads=32, kv_heads=4, ffn=5632),
    "7b": LlamaShape(vocab=32000, width=4096, layers=32, heads=32, kv_heads=32, ffn=11008),
    "70b": LlamaShape(vocab=128256, width=8192, layers=80, heads=64, kv_heads=8, ffn=28672),
}


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(width))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.heads, self.kv_heads = shape.heads, shape.kv_heads
        self.head_dim = shape.width // shape.heads
        self.q_proj = nn.Linear(shape.width, shape.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(shape.width, shape.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(shape.width, shape.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(shape.heads * self.head_dim, shape.width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t = x.size(0), x.size(1)
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads
        )
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.width, shape.ffn, bias=False)
        self.up_proj = nn.Linear(shape.width, shape.ffn, bias=False)
        self.down_proj = nn.Linear(shape.ffn, shape.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.width)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.width)
        self.mlp = MLP(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, shape: LlamaShape, seq: int = SEQ, theta: float = 500000.0) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab, shape.width)
        self.layers = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.norm = RMSNorm(shape.width)
        self.lm_head = nn.Linear(shape.width, shape.vocab, bias=False)
        head_dim = shape.width // shape.heads
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return self.lm_head(self.norm(x))


def build_125m() -> nn.Module:
    return Llama(SHAPES["125m"])


def build_1b() -> nn.Module:
    return Llama(SHAPES["1b"])


def build_7b() -> nn.Module:
    return Llama(SHAPES["7b"])


def build_70b() -> nn.Module:
    return Llama(SHAPES["70b"])


build_model = build_125m


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, SHAPES["125m"].vocab, (batch_size, SEQ), generator=g),)


def example_targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, SHAPES["125m"].vocab, (batch_size, SEQ), generator=g)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


def parameter_count(name: str) -> int:
    s = SHAPES[name]
    head_dim = s.width // s.heads
    attn = s.width * head_dim * (2 * s.heads + 2 * s.kv_heads)
    block = attn + 3 * s.width * s.ffn + 2 * s.width
    return 2 * s.vocab * s.width + s.layers * block + s.width


assert math.isclose(parameter_count("70b") / 1e9, 70.55, abs_tol=0.01)
