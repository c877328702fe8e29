"""Model file: small models whose train and eval modes compute different functions, one per way they differ.

Each factory shows one kind of difference between the train-mode and the eval-mode graph
(Note [aligning two traces] in ``fxpipe.tracer.train_eval.merge``):

* ``build_model``: a CNN with BatchNorm (a flipped flag and, on the export path, a train-only
  ``num_batches_tracked.add_(1)``), torchvision-style stochastic depth (``fx.wrap``-ped and called
  with ``self.training`` on the symbolic path; on the export path a train-only subgraph whose
  value replaces the block's output) and dropout, written without in-place ops;
* ``build_flip``: ``F.dropout(x, p, training=self.training)`` in user code (a flipped literal);
* ``build_p_zero``: attention with ``dropout_p=p if self.training else 0.0`` (p against 0);
* ``build_contiguous``: a ``.contiguous()`` made in train mode only (value-preserving);
* ``build_eval_only``: a rescaling done in eval mode only (an eval-only node and a switch);
* ``build_branchy``: two branches with dropout each, joined at the end (random ops in two branches).

``example_inputs`` gives images for ``build_model``; ``sequence_inputs`` a ``[B, 8, 16]`` batch for the rest.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


@torch.fx.wrap
def stochastic_depth(x: torch.Tensor, p: float, mode: str, training: bool = True) -> torch.Tensor:
    """torchvision's ``stochastic_depth``: drop whole samples (``"row"``) with probability ``p`` in training."""
    if not training or p == 0.0:
        return x
    size = [x.shape[0]] + [1] * (x.ndim - 1) if mode == "row" else [1] * x.ndim
    noise = torch.empty(size, dtype=x.dtype, device=x.device).bernoulli_(1 - p)
    noise.div_(1 - p)
    return x * noise


class StochasticDepth(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return stochastic_depth(x, self.p, "row", self.training)


class Block(nn.Module):
    def __init__(self, channels: int, p: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.act = nn.ReLU()
        self.sd = StochasticDepth(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.sd(self.act(self.bn(self.conv(x))))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.Sequential(*[Block(8, 0.2 * (i + 1)) for i in range(3)])
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.head(F.dropout(self.drop(x), 0.25, training=self.training))


class Flip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.dropout(torch.tanh(self.a(x)), 0.4, training=self.training))


class PZeroAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj, self.p = nn.Linear(16, 48), nn.Linear(16, 16), 0.3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, 16))


class Contiguous(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).transpose(1, 2)
        h = h.contiguous() if self.training else h
        return self.b(h.transpose(1, 2))


class EvalOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if not self.training:
            h = h * 0.5
        return self.b(h)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.5), nn.Linear(64, 16))
        self.right = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.5), nn.Linear(64, 16))
        self.out = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.left(x) * self.right(x))


def _seeded(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return cls()


def build_model() -> nn.Module:
    return _seeded(CNN)


def build_flip() -> nn.Module:
    return _seeded(Flip)


def build_p_zero() -> nn.Module:
    return _seeded(PZeroAttention)


def build_contiguous() -> nn.Module:
    return _seeded(Contiguous)


def build_eval_only() -> nn.Module:
    return _seeded(EvalOnly)


def build_branchy() -> nn.Module:
    return _seeded(Branchy)


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 3, 16, 16, generator=torch.Generator().manual_seed(1)),)


def example_targets(batch_size: int) -> torch.Tensor:
    return torch.arange(batch_size) % 10


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target) if output.dim() == 2 else output.square().mean()


def sequence_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 8, 16, generator=torch.Generator().manual_seed(2)),)
