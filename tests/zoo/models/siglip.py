"""SigLIP (SiglipModel, unwrapped: SiglipOutput) called with ``return_loss=True``: a ViT image tower with an attention-pooling head, a text tower, learned scale and bias, and the pairwise sigmoid loss over the B x B logits. No dropout.

Beside CLIP (issue 37): its loss's labels are ``torch.eye(logits.size(0))``, which keeps the batch size
symbolic, so unlike CLIP's ``torch.arange(len(logits))`` it traces with a dynamic batch."""

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
    from transformers import SiglipConfig, SiglipModel

    text, vision = towers()
    torch.manual_seed(0)
    text = {**text, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    return SiglipModel(SiglipConfig(text_config=text, vision_config=vision)).train()


example_kwargs = example_kwargs_labels = example_inputs
