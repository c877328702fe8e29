"""Qwen2-MoE: routed experts plus a gated shared expert."""

import torch
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM


def build_model():
    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    return Qwen2MoeForCausalLM(cfg)


def example_inputs(batch_size):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (batch_size, 10), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
