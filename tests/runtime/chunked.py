"""A hand-split chain model in any number of stages (chunks), placed on ranks like a real build.

``ChainLM(K)``: token ids -> embedding -> K tanh(Linear) layers -> plus the embedding
times a float model input (a skip connection from stage 0 straight to stage K-1) ->
logits through the embedding's weight (tied to stage 0). Stage c holds layer c; stage 0
also the embedding, stage K-1 the tied copy. With ``loop`` placement the tie and the skip
cross ranks; with ``v`` placement stages 0 and K-1 share rank 0, so the tie is shared in
memory and the skip is handed over locally.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from fxpipe.codegen.manifest import INPUT, BoundaryTensor, Manifest, StageManifest, Tie
from fxpipe.partitioner.schedule import stage_ranks
from handmade import loss_fn, token_batch

__all__ = [
    "ChainLM",
    "Chunk",
    "build_reference",
    "stage_loader",
    "manifest",
    "example_batch",
    "loss_fn",
]

VOCAB, WIDTH, SEQ, TRACED_MB = 13, 8, 4, 2


class ChainLM(nn.Module):
    def __init__(self, chunks: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(chunks))

    def forward(self, idx: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h0 = self.emb(idx)
        h = h0
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return (h + h0 * scale) @ self.emb.weight.t()


class Chunk(nn.Module):
    """Stage ``index`` of ``chunks``: layer ``index``, plus the embedding on the first and last."""

    def __init__(self, ref: ChainLM, index: int, chunks: int) -> None:
        super().__init__()
        self.index, self.chunks = index, chunks
        self.layers = nn.Module()
        self.layers.add_module(str(index), copy.deepcopy(ref.layers[index]))
        if index in (0, chunks - 1):
            self.emb = copy.deepcopy(ref.emb)

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        layer = getattr(self.layers, str(self.index))
        if self.index == 0:
            h0 = self.emb(args[0])
            out = torch.tanh(layer(h0))
            return (out, h0) if self.chunks > 1 else ((out + h0 * args[1]) @ self.emb.weight.t(),)
        if self.index < self.chunks - 1:
            return (torch.tanh(layer(args[0])),)
        h, h0, scale = args
        return ((torch.tanh(layer(h)) + h0 * scale) @ self.emb.weight.t(),)


def build_reference(chunks: int, seed: int = 0) -> ChainLM:
    torch.manual_seed(seed)
    return ChainLM(chunks)


def stage_loader(chunks: int, seed: int = 0):
    def load(index: int, device: torch.device) -> nn.Module:
        return Chunk(build_reference(chunks, seed), index, chunks).to(device)

    return load


def _t(name, shape, dtype, producer, consumers, requires_grad=True, model_output=None):
    return BoundaryTensor(name, shape, dtype, 0, producer, consumers, requires_grad, model_output)


def manifest(
    ranks: int, virtual_stages: int, placement: str = "loop", schedule: str | None = None
) -> Manifest:
    """The manifest of ``ChainLM(ranks * virtual_stages)`` split one layer per stage."""
    K, b = ranks * virtual_stages, TRACED_MB
    where = stage_ranks(ranks, virtual_stages, placement)
    idx = _t("idx", (b, SEQ), "int64", INPUT, (0,), requires_grad=False)
    scale = _t("scale", (b, 1, 1), "float32", INPUT, (K - 1,), requires_grad=False)
    hidden = [_t(f"h{c + 1}", (b, SEQ, WIDTH), "float32", c, (c + 1,)) for c in range(K - 1)]
    skip = _t("h0", (b, SEQ, WIDTH), "float32", 0, (K - 1,))
    logits = _t("logits", (b, SEQ, VOCAB), "float32", K - 1, (), model_output=0)
    stages = []
    for c in range(K):
        params = (f"layers.{c}.weight", f"layers.{c}.bias") + (
            ("emb.weight",) if c in (0, K - 1) else ()
        )
        if c == 0:
            inputs, outputs = (idx,), (hidden[0], skip)
        elif c < K - 1:
            inputs, outputs = (hidden[c - 1],), (hidden[c],)
        else:
            inputs, outputs = (hidden[c - 1], skip, scale), (logits,)
        stages.append(
            StageManifest(
                c,
                "Chunk",
                f"stage_{c}.py",
                f"stage_{c}.safetensors",
                "",
                "",
                inputs,
                outputs,
                params,
                rank=where[c],
            )
        )
    return Manifest(
        model_file="tests/runtime/chunked.py",
        model_fn="build_reference",
        model_sha256="",
        stages=tuple(stages),
        batch_size=2 * b,
        microbatch_size=b,
        inputs=(idx, scale),
        ties=(Tie((0, K - 1), ("emb.weight", "emb.weight")),),
        schedule=schedule,
    )


def example_batch(
    batch_size: int, seed: int = 1
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    return token_batch(batch_size, seed, VOCAB, SEQ)
