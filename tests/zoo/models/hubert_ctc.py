"""HuBERT for CTC (HubertForCTC, unwrapped: CausalLMOutput) called with ``labels=``: Wav2Vec2's conv feature encoder and convolutional positions, HuBERT's post-norm layers, CTC loss computed by the model. No dropout; SpecAugment on (transformers' default time masks, and feature masks), so train and eval mode differ.

The second model of its class (issue 37): its forward checks the labels against the vocabulary
(``if labels.max() >= vocab_size: raise``), kept as a runtime assert, and calls CTC loss with tensor lengths.
In train mode it masks its features with numpy (SpecAugment): the stage draws new masks at every call
from numpy's global state (Note [masks drawn on the host]); the comparison seeds numpy for both sides."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))  # for _zoo.py next to this file

from wav2vec2_ctc import config, example_inputs  # noqa: F401 - the same audio and labels

DROPOUT = True  # SpecAugment: train mode masks features, eval mode does not
KWARGS_ONLY = True  # labels= is a keyword of the model's own loss


def build_model():
    from transformers import HubertConfig, HubertForCTC

    torch.manual_seed(0)
    return HubertForCTC(
        HubertConfig(
            **config(
                do_stable_layer_norm=False,
                mask_time_prob=0.05,  # transformers' default: 2 masks of 10 frames (min_masks)
                mask_feature_prob=0.1,
                mask_feature_length=8,
            )
        )
    ).train()


example_kwargs = example_kwargs_labels = example_inputs
