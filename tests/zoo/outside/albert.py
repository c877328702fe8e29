"""ALBERT masked LM: one transformer layer's weights shared by every layer, factorised embeddings."""

import torch
from transformers import AlbertConfig, AlbertForMaskedLM


def build_model():
    torch.manual_seed(0)
    cfg = AlbertConfig(
        vocab_size=128,
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return AlbertForMaskedLM(cfg)


def example_inputs(batch_size):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (batch_size, 10), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
