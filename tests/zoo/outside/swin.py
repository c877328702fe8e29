"""HF Swin image classifier: shifted windows, relative position bias, drop path."""

import torch
from transformers import SwinConfig, SwinForImageClassification


def build_model():
    torch.manual_seed(0)
    cfg = SwinConfig(
        image_size=32,
        patch_size=2,
        embed_dim=16,
        depths=[2, 2],
        num_heads=[2, 4],
        window_size=4,
        drop_path_rate=0.1,
        hidden_dropout_prob=0.1,
        num_labels=5,
    )
    return SwinForImageClassification(cfg)


def example_inputs(batch_size):
    g = torch.Generator().manual_seed(1)
    return {
        "pixel_values": torch.randn(batch_size, 3, 32, 32, generator=g),
        "labels": torch.randint(0, 5, (batch_size,), generator=g),
    }
