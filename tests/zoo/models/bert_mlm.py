"""BERT with its masked-LM head (BertForMaskedLM, unwrapped: MaskedLMOutput): post-LayerNorm encoder, tied decoder. Dropout 0.1 (hidden, attention)."""

from __future__ import annotations

import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))  # for _zoo.py next to this file

import _zoo  # noqa: E402
from _zoo import lm_inputs as example_inputs, mlm_targets as example_targets, token_loss as loss_fn  # noqa: E402,F401

DROPOUT = True
KWARGS_ONLY = False  # forward(input_ids, attention_mask, token_type_ids, ...)


def build_model():
    from transformers import BertConfig, BertForMaskedLM

    return _zoo.build_hf(
        BertConfig,
        BertForMaskedLM,
        vocab_size=_zoo.VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )


def example_kwargs(batch_size: int):
    return _zoo.lm_kwargs(batch_size)


def example_kwargs_labels(batch_size: int):
    return {**_zoo.lm_kwargs(batch_size), "labels": _zoo.mlm_targets(batch_size)}
