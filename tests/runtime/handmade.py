"""A tiny hand-split model for runtime tests that need no tracer or codegen.

``TinyLM`` has what the runtime must get right: integer token ids (no gradient), a
float model input read directly by the last stage, an int64 mask crossing a stage
boundary (no gradient sent back), a skip connection from stage 0 over stage 1 to
stage 2, and an embedding tied to the output projection on stages 0 and 2.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.codegen.manifest import INPUT, BoundaryTensor, Manifest, StageManifest, Tie

VOCAB, WIDTH, SEQ, TRACED_MB = 11, 8, 5, 2


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.l1 = nn.Linear(WIDTH, WIDTH)
        self.l2 = nn.Linear(WIDTH, WIDTH)

    def forward(self, idx: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h0 = self.emb(idx)
        keep = (idx > 0).long()
        h1 = torch.tanh(self.l1(h0)) * keep.unsqueeze(-1)
        h2 = torch.tanh(self.l2(h1)) + h0 * scale
        return h2 @ self.emb.weight.t()


class Stage0(nn.Module):
    def __init__(self, ref: TinyLM) -> None:
        super().__init__()
        self.emb = copy.deepcopy(ref.emb)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.emb(idx), (idx > 0).long()


class Stage1(nn.Module):
    def __init__(self, ref: TinyLM) -> None:
        super().__init__()
        self.l1 = copy.deepcopy(ref.l1)

    def forward(self, h0: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.tanh(self.l1(h0)) * keep.unsqueeze(-1),)


class Stage2(nn.Module):
    def __init__(self, ref: TinyLM) -> None:
        super().__init__()
        self.l2 = copy.deepcopy(ref.l2)
        self.emb = copy.deepcopy(ref.emb)  # the tied copy

    def forward(
        self, h1: torch.Tensor, h0: torch.Tensor, scale: torch.Tensor
    ) -> tuple[torch.Tensor]:
        return ((torch.tanh(self.l2(h1)) + h0 * scale) @ self.emb.weight.t(),)


STAGES = (Stage0, Stage1, Stage2)


def build_reference(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def stage_loader(seed: int = 0):
    """A ``StageLoader`` that builds stage i from the seeded reference model."""

    def load(index: int, device: torch.device) -> nn.Module:
        return STAGES[index](build_reference(seed)).to(device)

    return load


def _t(name, shape, dtype, producer, consumers, requires_grad=True, model_output=None, batch_dim=0):
    return BoundaryTensor(
        name, shape, dtype, batch_dim, producer, consumers, requires_grad, model_output
    )


def manifest() -> Manifest:
    b = TRACED_MB
    idx = _t("idx", (b, SEQ), "int64", INPUT, (0,), requires_grad=False)
    scale = _t("scale", (b, 1, 1), "float32", INPUT, (2,), requires_grad=False)
    h0 = _t("h0", (b, SEQ, WIDTH), "float32", 0, (1, 2))
    keep = _t("keep", (b, SEQ), "int64", 0, (1,), requires_grad=False)
    h1 = _t("h1", (b, SEQ, WIDTH), "float32", 1, (2,))
    logits = _t("logits", (b, SEQ, VOCAB), "float32", 2, (), model_output=0)

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
        model_file="tests/runtime/handmade.py",
        model_fn="build_reference",
        model_sha256="",
        stages=(
            stage(0, (idx,), (h0, keep), ("emb.weight",)),
            stage(1, (h0, keep), (h1,), ("l1.weight", "l1.bias")),
            stage(2, (h1, h0, scale), (logits,), ("l2.weight", "l2.bias", "emb.weight")),
        ),
        batch_size=2 * b,
        microbatch_size=b,
        inputs=(idx, scale),
        ties=(Tie((0, 2), ("emb.weight", "emb.weight")),),
    )


def token_batch(
    batch_size: int,
    seed: int,
    vocab: int,
    seq: int,
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Token ids, a float scale per sample and target ids: a language model's batch."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (batch_size, seq), generator=g)
    scale = torch.rand(batch_size, 1, 1, generator=g)
    target = torch.randint(0, vocab, (batch_size, seq), generator=g)
    return (idx, scale), target


def example_batch(
    batch_size: int, seed: int = 1
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    return token_batch(batch_size, seed, VOCAB, SEQ)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.size(-1)), target.reshape(-1))
