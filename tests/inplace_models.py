"""Model file: small models that change tensors in place, one per way a pipeline can get it wrong.

Each factory changes a tensor in place that is read elsewhere too (Note [in-place ops
across stages] in ``fxpipe.tracer.frontend.mutation``); split at the modules named in ``SPLITS``,
a stage that receives a tensor reads it before or after another stage changes it:

* ``build_model``: ``skip = h; h = self.act(h)`` with ``nn.ReLU(inplace=True)``: the sum at the
  end reads ``skip``, which the ReLU changed (the graph reads the stale name);
* ``build_functional``: the same through calls, not modules: ``x.mul_(0.5).add_(0.1)`` and
  ``F.relu(x, inplace=True)`` inside a small user module (the checks on modules never saw these);
* ``build_view_write``: a write through a view (``h[:, :8].relu_()``) that changes ``h`` (so ``a``
  and ``act`` share a unit: its splits are ``b`` and ``c``);
* ``build_residual_stream``: ``h += block(h)`` in every block: one tensor changed by every block;
* ``build_eval_only``: ``x.mul_(0.5)`` in eval mode only (so, like a write through a view, ``a``
  and ``act`` share a unit).

``example_inputs``, ``example_targets`` and ``loss_fn`` serve them all.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH = 16
SPLITS = {
    "build_model": ("act", "c"),
    "build_functional": ("act", "c"),
    "build_view_write": ("b", "c"),
    "build_residual_stream": ("blocks.1", "blocks.3"),
    "build_eval_only": ("b", "c"),
}


class SkipAroundInPlace(nn.Module):
    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.act = act
        self.b = nn.Linear(WIDTH, WIDTH)
        self.c = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        skip = h
        h = self.act(h)  # changes skip too
        h = self.b(h)
        return self.c(h) + skip


class ScaleShiftRelu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5).add_(0.1)
        return F.relu(x, inplace=True)


class ViewWrite(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x[:, : WIDTH // 2].relu_()  # writes half of x through a view; returns nothing new
        return x * 2.0


class EvalOnlyHalf(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            x.mul_(0.5)
        return x * 3.0


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.scale = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(
            self.fc(self.norm(x * self.scale))
        )  # saves no x: `h += block(h)` may change it


class ResidualStream(nn.Module):
    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        first = h
        for block in self.blocks:
            h += block(h)
        return self.head(h) + first  # first is h: changed by every block


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return SkipAroundInPlace(nn.ReLU(inplace=True))


def build_functional() -> nn.Module:
    torch.manual_seed(0)
    return SkipAroundInPlace(ScaleShiftRelu())


def build_view_write() -> nn.Module:
    torch.manual_seed(0)
    return SkipAroundInPlace(ViewWrite())


def build_residual_stream() -> nn.Module:
    torch.manual_seed(0)
    return ResidualStream()


def build_eval_only() -> nn.Module:
    torch.manual_seed(0)
    return SkipAroundInPlace(EvalOnlyHalf())


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, WIDTH, generator=torch.Generator().manual_seed(1)),)


def example_targets(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, WIDTH, generator=torch.Generator().manual_seed(2))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)
