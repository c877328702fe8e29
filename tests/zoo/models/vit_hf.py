"""ViT from transformers (ViTForImageClassification, unwrapped: ImageClassifierOutput): 8x8 patches of 32x32 images, CLS token, 4 layers of width 32. Dropout 0.1 (hidden)."""

from __future__ import annotations

import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))  # for _zoo.py next to this file

import _zoo  # noqa: E402
from _zoo import class_loss as loss_fn, class_targets as example_targets, images as example_inputs  # noqa: E402,F401

DROPOUT = True
KWARGS_ONLY = False  # forward(pixel_values, labels, ...)


def build_model():
    from transformers import ViTConfig, ViTForImageClassification

    return _zoo.build_hf(
        ViTConfig,
        ViTForImageClassification,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=_zoo.IMAGE,
        patch_size=8,
        num_labels=_zoo.CLASSES,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.0,
    )


def example_kwargs(batch_size: int):
    return {"pixel_values": _zoo.images(batch_size)}


def example_kwargs_labels(batch_size: int):
    return {"pixel_values": _zoo.images(batch_size), "labels": _zoo.class_targets(batch_size)}
