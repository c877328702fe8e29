"""GPT-J (GPTJForCausalLM, unwrapped): rotary on the first 4 dims of each head, parallel attention/MLP, untied head. No dropout.

forward(input_ids, past_key_values, attention_mask, ...): example_kwargs gives the padded HF call."""

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

DROPOUT = False
KWARGS_ONLY = True  # the padded call needs keyword inputs (attention_mask is the third parameter)


def build_model():
    from transformers import GPTJConfig, GPTJForCausalLM

    return _zoo.build_hf(
        GPTJConfig,
        GPTJForCausalLM,
        vocab_size=_zoo.VOCAB,
        n_positions=64,
        n_embd=32,
        n_layer=4,
        n_head=4,
        rotary_dim=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
