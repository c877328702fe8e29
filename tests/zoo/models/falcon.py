"""Falcon (FalconForCausalLM, unwrapped): multi-query attention, RoPE, parallel attention/MLP. Dropout 0.1 (hidden, attention).

forward(input_ids, past_key_values, attention_mask, ...): the mask cannot be passed positionally (past_key_values comes
first), so example_inputs gives input_ids only and example_kwargs the HF call with the mask."""

from __future__ import annotations

import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))  # for _zoo.py next to this file

import _zoo  # noqa: E402
from _zoo import (
    lm_kwargs as example_kwargs,
    lm_kwargs_labels as example_kwargs_labels,  # noqa: E402,F401
    next_token_targets as example_targets,
    token_ids as example_inputs,
    token_loss as loss_fn,
)

DROPOUT = True
KWARGS_ONLY = True  # the padded call needs keyword inputs (attention_mask is the third parameter)


def build_model():
    from transformers import FalconConfig, FalconForCausalLM

    return _zoo.build_hf(
        FalconConfig,
        FalconForCausalLM,
        vocab_size=_zoo.VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
