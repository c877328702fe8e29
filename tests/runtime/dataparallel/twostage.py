"""A tiny hand-split 2-stage model for the data-parallel tests.

``TwoStageLM`` has an embedding tied to the output projection (stage 0 and stage 1
each hold a copy, summed by the tie group), and stage 1 owns a parameter that its
forward never uses (DDP would need ``find_unused_parameters`` for it).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.codegen.manifest import INPUT, BoundaryTensor, Manifest, StageManifest, Tie

VOCAB, WIDTH, SEQ, TRACED_MB = 11, 8, 4, 2


class TwoStageLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.l1 = nn.Linear(WIDTH, WIDTH)
        self.l2 = nn.Linear(WIDTH, WIDTH)
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(self.emb(idx)))
        return torch.tanh(self.l2(h)) @ self.emb.weight.t()


class Stage0(nn.Module):
    def __init__(self, ref: TwoStageLM) -> None:
        super().__init__()
        self.emb = copy.deepcopy(ref.emb)
        self.l1 = copy.deepcopy(ref.l1)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.tanh(self.l1(self.emb(idx))),)


class Stage1(nn.Module):
    def __init__(self, ref: TwoStageLM) -> None:
        super().__init__()
        self.l2 = copy.deepcopy(ref.l2)
        self.emb = copy.deepcopy(ref.emb)  # the tied copy
        self.unused = copy.deepcopy(ref.unused)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.tanh(self.l2(h)) @ self.emb.weight.t(),)


def build_reference(seed: int = 0) -> TwoStageLM:
    torch.manual_seed(seed)
    return TwoStageLM()


def stage_loader(seed: int = 0):
    """Stage i built from the seeded reference; every replica gets the same weights."""

    def load(index: int, device: torch.device) -> nn.Module:
        return (Stage0, Stage1)[index](build_reference(seed)).to(device)

    return load


def manifest() -> Manifest:
    b = TRACED_MB
    idx = BoundaryTensor("idx", (b, SEQ), "int64", 0, INPUT, (0,), False)
    h = BoundaryTensor("h", (b, SEQ, WIDTH), "float32", 0, 0, (1,), True)
    logits = BoundaryTensor("logits", (b, SEQ, VOCAB), "float32", 0, 1, (), True, 0)

    def stage(i, inputs, outputs, params):
        return StageManifest(
            i,
            f"Stage{i}",
            f"stage_{i}.py",
            f"stage_{i}.safetensors",
            "",
            "",
            inputs,
            outputs,
            params,
        )

    return Manifest(
        model_file="tests/runtime/dataparallel/twostage.py",
        model_fn="build_reference",
        model_sha256="",
        stages=(
            stage(0, (idx,), (h,), ("emb.weight", "l1.weight", "l1.bias")),
            stage(1, (h,), (logits,), ("l2.weight", "l2.bias", "emb.weight", "unused")),
        ),
        batch_size=2 * b,
        microbatch_size=b,
        inputs=(idx,),
        ties=(Tie((0, 1), ("emb.weight", "emb.weight")),),
    )


def batch(
    batch_size: int, seed: int, vocab: int = VOCAB
) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (batch_size, SEQ), generator=g)
    target = torch.randint(0, vocab, (batch_size, SEQ), generator=g)
    return (idx,), target


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.size(-1)), target.reshape(-1))
