"""A transformers Llama (LlamaForCausalLM, returned unwrapped) of gpt_medium's size for the runtime
benchmarks: RMSNorm, rotary embeddings, grouped-query attention (transformers' SDPA path), SwiGLU."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, WIDTH, FFN, HEADS, KV_HEADS, LAYERS = 512, 64, 128, 344, 4, 2, 6


def build_model() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=SEQ,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (batch_size, SEQ), generator=g),)


def example_targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)


def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the logits (the model's output, or the bare logits a peer's last stage
    returns) against the next tokens."""
    logits = output if isinstance(output, torch.Tensor) else output["logits"]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
