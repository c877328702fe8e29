"""Whisper (WhisperForConditionalGeneration, unwrapped: Seq2SeqLMOutput): conv front end over log-mel features, encoder with a FROZEN sinusoidal position table (``embed_positions.weight.requires_grad`` is False), decoder with learned positions, tied head. No dropout.

Positional call: (input_features, attention_mask=None, decoder_input_ids). The frozen table has no gradient in the original, so none in the stages either (issue 37)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))  # for _zoo.py next to this file

import _zoo  # noqa: E402
from _zoo import seq2seq_targets as example_targets, token_loss as loss_fn  # noqa: E402,F401

DROPOUT = False
KWARGS_ONLY = True  # forward(input_features, attention_mask, decoder_input_ids, ...): the mask is not a tensor here
MELS = 8
FRAMES = 32  # 2 x max_source_positions: the encoder's second conv halves it
DECODER_START = 2


def build_model():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    return _zoo.build_hf(
        WhisperConfig,
        WhisperForConditionalGeneration,
        vocab_size=_zoo.VOCAB,
        num_mel_bins=MELS,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=FRAMES // 2,
        max_target_positions=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=DECODER_START,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )


def features(batch_size: int) -> torch.Tensor:
    """``[B, mels, frames]`` log-mel-like features."""
    return torch.randn(batch_size, MELS, FRAMES, generator=torch.Generator().manual_seed(5))


def example_inputs(batch_size: int):
    _, _, decoder_ids = _zoo.seq2seq_inputs(batch_size, DECODER_START)
    return {"input_features": features(batch_size), "decoder_input_ids": decoder_ids}


def example_kwargs(batch_size: int):
    return example_inputs(batch_size)


def example_kwargs_labels(batch_size: int):
    return {"input_features": features(batch_size), "labels": example_targets(batch_size)}
