"""A new user's Llama variant: multi-query attention (1 KV head), tied embeddings, linear RoPE scaling, biases, attention dropout."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
        attention_dropout=0.1,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        max_position_embeddings=64,
        use_cache=False,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg)


def example_inputs(batch_size):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (batch_size, 10), generator=g)
    return {"input_ids": ids, "labels": ids}
