"""HuBERT for CTC (HubertForCTC, unwrapped: CausalLMOutput) called with ``labels=``: Wav2Vec2's conv feature encoder and convolutional positions, HuBERT's post-norm layers, CTC loss computed by the model. No dropout, no SpecAugment.

The second model of its class (issue 37): its forward checks the labels against the vocabulary
(``if labels.max() >= vocab_size: raise``), kept as a runtime assert, and calls CTC loss with tensor lengths."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))  # for _zoo.py next to this file

from wav2vec2_ctc import config, example_inputs  # noqa: F401 - the same audio and labels

DROPOUT = False
KWARGS_ONLY = True  # labels= is a keyword of the model's own loss


def build_model():
    from transformers import HubertConfig, HubertForCTC

    torch.manual_seed(0)
    return HubertForCTC(HubertConfig(**config(do_stable_layer_norm=False))).train()


example_kwargs = example_kwargs_labels = example_inputs
