"""The benchmark's model file: a tiny transformers Llama (its own loss, ``labels=``) over a fixed
variable-length data set, batched by length; ``FXPIPE_SHAPES_PAD`` says how each batch is padded.

* ``bucket`` (the dynamic build): each batch padded to its own longest sample;
* ``longest`` (the static build): every batch padded to the longest sample in the data set.

Pad positions carry the pad token in ``input_ids`` and ``-100`` in ``labels`` (the loss ignores
them); padding is on the right and attention is causal, so real tokens never see a pad and both
modes train on the same real tokens. ``FXPIPE_SHAPES_TRACE_LEN`` sets the traced length and
``FXPIPE_SHAPES_DYNAMIC=0`` drops ``dynamic_dims()``'s range (a static build).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, PAD = 256, 0
MAX_LEN = 128  # the longest sample in the data set (the data set contains one)
SAMPLES, BATCH = 192, 8  # 24 batches


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LEN,
        tie_word_embeddings=True,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def dynamic_dims() -> dict[str, Any]:
    if os.environ.get("FXPIPE_SHAPES_DYNAMIC", "1") == "0":
        return {}
    return {"input_ids": {1: ("seq", 2, MAX_LEN)}, "labels": {1: ("seq", 2, MAX_LEN)}}


def lengths() -> list[int]:
    """The data set's sample lengths: long-tailed (log-normal, median ~30), 8..MAX_LEN."""
    g = torch.Generator().manual_seed(1)
    raw = torch.exp(torch.randn(SAMPLES, generator=g) * 0.6 + 3.4).round().clamp(8, MAX_LEN)
    out = [int(v) for v in raw]
    out[0] = MAX_LEN
    return out


def batches() -> list[list[int]]:
    """Sample indices per batch: sorted by length, cut into batches, batch order shuffled."""
    lens = lengths()
    order = sorted(range(SAMPLES), key=lambda i: lens[i])
    cut = [order[i : i + BATCH] for i in range(0, SAMPLES, BATCH)]
    perm = torch.randperm(len(cut), generator=torch.Generator().manual_seed(2)).tolist()
    return [cut[p] for p in perm]


def _sample(i: int, length: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (length,), generator=torch.Generator().manual_seed(1000 + i))


def padded_batch(indices: list[int], pad_to: int) -> dict[str, torch.Tensor]:
    lens = lengths()
    ids = torch.full((len(indices), pad_to), PAD, dtype=torch.long)
    labels = torch.full((len(indices), pad_to), -100, dtype=torch.long)
    for row, i in enumerate(indices):
        s = _sample(i, lens[i])
        ids[row, : lens[i]] = s
        labels[row, : lens[i]] = s
    return {"input_ids": ids, "labels": labels}


def pad_length(indices: list[int]) -> int:
    if os.environ.get("FXPIPE_SHAPES_PAD", "bucket") == "longest":
        return MAX_LEN
    return max(lengths()[i] for i in indices)


def example_inputs(batch_size: int) -> dict[str, torch.Tensor]:
    length = int(os.environ.get("FXPIPE_SHAPES_TRACE_LEN", "32"))
    ids = torch.randint(1, VOCAB, (batch_size, length), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def train_batches(batch_size: int, rank_info: Any) -> Iterator[tuple[Any, Any]]:
    assert batch_size == BATCH, batch_size
    all_batches = batches()
    step = 0
    while True:
        indices = all_batches[step % len(all_batches)]
        yield padded_batch(indices, pad_length(indices)), None
        step += 1
