"""Wav2Vec2 for CTC (Wav2Vec2ForCTC, unwrapped: CausalLMOutput) called with ``labels=``: conv feature encoder over raw audio, convolutional positions, 2 transformer layers, CTC loss computed by the model. No dropout, no SpecAugment (``mask_time_prob=0``).

Its forward checks the labels against the vocabulary (``if labels.max() >= vocab_size: raise ValueError``),
a check on the data: the trace keeps it as a runtime assert instead of stopping at it (issue 37)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))  # for _zoo.py next to this file

import _zoo  # noqa: E402

DROPOUT = False
KWARGS_ONLY = True  # labels= is a keyword of the model's own loss
SAMPLES = 400  # raw audio samples: 400 -> 79 -> 39 frames through the two convolutions
VOCAB = 12
LABELS = 6


def config(**overrides):
    """The tiny speech-encoder hyperparameters Wav2Vec2 and HuBERT share."""
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        feat_proj_dropout=0.0,
        final_dropout=0.0,
        layerdrop=0.0,
        mask_time_prob=0.0,
        mask_feature_prob=0.0,
        pad_token_id=0,
        ctc_loss_reduction="mean",
    )
    base.update(overrides)
    return base


def build_model():
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    torch.manual_seed(0)
    return Wav2Vec2ForCTC(Wav2Vec2Config(**config())).train()


def audio(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, SAMPLES, generator=torch.Generator().manual_seed(6))


def labels(batch_size: int) -> torch.Tensor:
    """``[B, 6]`` character ids (never the pad id 0), the last sample's final two padded with -100."""
    ids = torch.randint(1, VOCAB, (batch_size, LABELS), generator=torch.Generator().manual_seed(7))
    ids[-1, -2:] = -100
    return ids


def example_inputs(batch_size: int):
    return {"input_values": audio(batch_size), "labels": labels(batch_size)}


example_kwargs = example_kwargs_labels = example_inputs
