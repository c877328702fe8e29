"""A transformers Llama (tied embeddings) called with ``input_ids=`` and ``labels=``, whose batches
change their sequence length every step; ``dynamic_dims()`` declares the sequence dimension."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 64
LENGTHS = (8, 16, 5, 12)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def dynamic_dims() -> dict[str, Any]:
    return {"input_ids": {1: ("seq", 2, 64)}, "labels": {1: ("seq", 2, 64)}}


def _call(batch_size: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch_size, length), generator=g)
    return {"input_ids": ids, "labels": ids}


def example_inputs(batch_size: int) -> dict[str, torch.Tensor]:
    return _call(batch_size, 16, 0)


def train_batches(batch_size: int, rank_info: Any) -> Iterator[tuple[Any, Any]]:
    step = 0
    while True:
        yield _call(batch_size, LENGTHS[step % len(LENGTHS)], 100 * rank_info.replica + step), None
        step += 1
