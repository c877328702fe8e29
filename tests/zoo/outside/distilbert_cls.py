"""DistilBERT sequence classification with labels= (the model's own loss)."""

import torch
from transformers import DistilBertConfig, DistilBertForSequenceClassification


def build_model():
    torch.manual_seed(0)
    cfg = DistilBertConfig(
        vocab_size=128,
        dim=32,
        hidden_dim=64,
        n_layers=3,
        n_heads=4,
        num_labels=3,
        max_position_embeddings=64,
    )
    return DistilBertForSequenceClassification(cfg)


def example_inputs(batch_size):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (batch_size, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, -3:] = 0
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": torch.randint(0, 3, (batch_size,), generator=g),
    }
