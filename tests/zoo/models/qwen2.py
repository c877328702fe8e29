"""Qwen2 (Qwen2ForCausalLM, unwrapped): RoPE, GQA with q/k/v biases, untied head. No dropout."""

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

DROPOUT = False
KWARGS_ONLY = False


def build_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _zoo.build_hf(
        Qwen2Config, Qwen2ForCausalLM, **_zoo.decoder_config(tie_word_embeddings=False)
    )
