"""A tiny transformers Llama for the tensor-parallel tests: GQA (4 heads, 2 KV heads), tied
embeddings, called with ``labels=`` so the model computes its own loss."""

from __future__ import annotations

import torch
import torch.nn as nn

VOCAB, SEQ = 96, 16


def build_model() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
        use_cache=False,
        attention_dropout=0.0,
    )
    return LlamaForCausalLM(config).train()


def example_inputs(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (batch_size, SEQ), generator=g)
    return {"input_ids": ids, "labels": torch.randint(1, VOCAB, (batch_size, SEQ), generator=g)}
