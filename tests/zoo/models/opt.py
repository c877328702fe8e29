"""OPT (OPTForCausalLM, unwrapped): learned positions offset by 2, ReLU MLP, pre-LayerNorm. Dropout 0.1 (hidden, attention)."""

from __future__ import annotations

import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))  # for _zoo.py next to this file

import _zoo  # noqa: E402
from _zoo import (
    lm_inputs as example_inputs,
    lm_kwargs as example_kwargs,  # noqa: E402,F401
    lm_kwargs_labels as example_kwargs_labels,
    next_token_targets as example_targets,
    token_loss as loss_fn,
)

DROPOUT = True
KWARGS_ONLY = False


def build_model():
    from transformers import OPTConfig, OPTForCausalLM

    return _zoo.build_hf(
        OPTConfig,
        OPTForCausalLM,
        vocab_size=_zoo.VOCAB,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        word_embed_proj_dim=32,
        max_position_embeddings=64,
        dropout=0.1,
        attention_dropout=0.1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
