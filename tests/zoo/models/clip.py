"""CLIP (CLIPModel, unwrapped: CLIPOutput) called with ``return_loss=True``: a ViT image tower and a causal text tower, projections, a learned temperature, and the symmetric contrastive loss over the B x B similarity matrix. No dropout.

The loss's targets are ``torch.arange(len(logits))``: the batch size becomes a constant of the graph, so the
build is traced static at the microbatch size and says so (issue 37)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))  # for _zoo.py next to this file

import _zoo  # noqa: E402

DROPOUT = False
KWARGS_ONLY = True  # return_loss= is a keyword
TEXT = 8


def towers(**extra):
    """Tiny text and vision tower hyperparameters CLIP and SigLIP share."""
    text = dict(
        vocab_size=_zoo.VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=TEXT,
        attention_dropout=0.0,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=_zoo.IMAGE,
        patch_size=8,
        attention_dropout=0.0,
    )
    return text, vision


def build_model():
    from transformers import CLIPConfig, CLIPModel

    text, vision = towers()
    torch.manual_seed(0)
    config = CLIPConfig(
        text_config={**text, "eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 0},
        vision_config=vision,
        projection_dim=16,
    )
    return CLIPModel(config).train()


def example_inputs(batch_size: int):
    return {
        "input_ids": _zoo.token_ids(batch_size, seq=TEXT),
        "pixel_values": _zoo.images(batch_size),
        "return_loss": True,
    }


example_kwargs = example_kwargs_labels = example_inputs
