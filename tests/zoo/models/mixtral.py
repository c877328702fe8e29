"""Mixtral (MixtralForCausalLM, unwrapped): sparse mixture of experts (4 experts, top-2 routing), RoPE, GQA. No dropout, no router jitter."""

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
    from transformers import MixtralConfig, MixtralForCausalLM

    return _zoo.build_hf(
        MixtralConfig,
        MixtralForCausalLM,
        **_zoo.decoder_config(
            num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0, sliding_window=None
        ),
    )
