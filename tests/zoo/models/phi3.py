"""Phi-3 (Phi3ForCausalLM, unwrapped): fused qkv and gate_up projections, partial RoPE. Dropout 0.1 (embedding, residual, attention)."""

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
    from transformers import Phi3Config, Phi3ForCausalLM

    return _zoo.build_hf(
        Phi3Config,
        Phi3ForCausalLM,
        **_zoo.decoder_config(
            resid_pdrop=0.1, embd_pdrop=0.1, attention_dropout=0.1, partial_rotary_factor=0.5
        ),
    )
