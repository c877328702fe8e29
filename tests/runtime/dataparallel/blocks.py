"""A hand-split 2-stage model with module stacks, for the sharding tests.

``BlockLM``: an embedding, four residual blocks in a ``ModuleList`` (two per stage) and
an output projection tied to the embedding. Under ``shard_wrap="block"`` each block is
an FSDP unit; the embedding (stage 0) and its tied copy, read directly as a weight by
stage 1, stay in the root unit with an ``unused`` parameter (no gradient: FSDP must
cope with it, and the optimizer never gets state for it).
"""

from __future__ import annotations

import torch
import torch.nn as nn

import twostage
from fxpipe.codegen.manifest import INPUT, BoundaryTensor, Manifest, StageManifest, Tie

VOCAB, WIDTH, TRACED_MB = 13, 16, 2
SEQ = twostage.SEQ


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class BlockLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        return h @ self.emb.weight.t()


class Stage0(nn.Module):
    def __init__(self, ref: BlockLM) -> None:
        super().__init__()
        self.emb = ref.emb
        self.blocks = nn.ModuleDict({str(i): ref.blocks[i] for i in (0, 1)})

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor]:
        h = self.emb(idx)
        for block in self.blocks.values():
            h = block(h)
        return (h,)


class Stage1(nn.Module):
    def __init__(self, ref: BlockLM) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({str(i): ref.blocks[i] for i in (2, 3)})
        self.emb = ref.emb  # the tied copy (its own module in this process)
        self.unused = ref.unused

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor]:
        for block in self.blocks.values():
            h = block(h)
        return (h @ self.emb.weight.t(),)


def build_reference(seed: int = 0) -> BlockLM:
    torch.manual_seed(seed)
    return BlockLM()


def stage_loader(seed: int = 0):
    """Stage i built from the seeded reference (a fresh copy per call: every replica the same weights)."""

    def load(index: int, device: torch.device) -> nn.Module:
        return (Stage0, Stage1)[index](build_reference(seed)).to(device)

    return load


def stage_params(index: int) -> tuple[str, ...]:
    return tuple(k for k, _ in (Stage0, Stage1)[index](build_reference()).named_parameters())


def manifest() -> Manifest:
    b = TRACED_MB
    idx = BoundaryTensor("idx", (b, SEQ), "int64", 0, INPUT, (0,), False)
    h = BoundaryTensor("h", (b, SEQ, WIDTH), "float32", 0, 0, (1,), True)
    logits = BoundaryTensor("logits", (b, SEQ, VOCAB), "float32", 0, 1, (), True, 0)

    def stage(i, inputs, outputs):
        return StageManifest(
            i,
            f"Stage{i}",
            f"stage_{i}.py",
            f"stage_{i}.safetensors",
            "",
            "",
            inputs,
            outputs,
            stage_params(i),
        )

    return Manifest(
        model_file="tests/runtime/dataparallel/blocks.py",
        model_fn="build_reference",
        model_sha256="",
        stages=(stage(0, (idx,), (h,)), stage(1, (h,), (logits,))),
        batch_size=2 * b,
        microbatch_size=b,
        inputs=(idx,),
        ties=(Tie((0, 1), ("emb.weight", "emb.weight")),),
    )


def batch(batch_size: int, seed: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    return twostage.batch(batch_size, seed, VOCAB)


loss_fn = twostage.loss_fn
