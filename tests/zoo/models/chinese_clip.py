"""Chinese-CLIP (ChineseCLIPModel, unwrapped: ChineseCLIPOutput) called with ``return_loss=True``: a BERT text tower, a CLIP ViT image tower, projections and CLIP's contrastive loss. No dropout.

The second model of CLIP's class (issue 37): its loss's ``torch.arange(len(logits))`` fixes the batch,
so the build is traced static at the microbatch size and says so."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))  # for _zoo.py next to this file

from clip import example_inputs, towers  # noqa: F401 - the same ids, images and return_loss=True

DROPOUT = False
KWARGS_ONLY = True  # return_loss= is a keyword


def build_model():
    from transformers import ChineseCLIPConfig, ChineseCLIPModel

    text, vision = towers()
    text = {
        "vocab_size": text["vocab_size"],
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 16,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "pad_token_id": 0,
    }
    torch.manual_seed(0)
    config = ChineseCLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    return ChineseCLIPModel(config).train()


example_kwargs = example_kwargs_labels = example_inputs
