"""A LoRA-adapted Llama (LlamaForCausalLM, unwrapped): the whole base model FROZEN (``requires_grad=False``), trainable low-rank adapters on every attention's q and v projections. No dropout.

``LoRALinear`` is written here as the peft library writes it (``base(x) + B(A(dropout(x))) * alpha / r``), with no
peft dependency. ``lora_B`` starts small and random instead of zero, so that both adapter matrices have a
gradient at the first step (with zeros, ``lora_A``'s gradient is zero and a check of it proves nothing).
The stages must keep the base frozen: no gradient, no optimizer state, unchanged by training (issue 37)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))  # for _zoo.py next to this file

import _zoo  # noqa: E402
from _zoo import (  # noqa: E402,F401
    lm_inputs as example_inputs,
    lm_kwargs as example_kwargs,
    lm_kwargs_labels as example_kwargs_labels,
    next_token_targets as example_targets,
    token_loss as loss_fn,
)

DROPOUT = False
KWARGS_ONLY = False
RANK = 4
ALPHA = 8


class LoRALinear(nn.Module):
    """``base(x) + lora_B(lora_A(x)) * alpha / r`` around a frozen ``nn.Linear``."""

    def __init__(self, base: nn.Linear, r: int = RANK, alpha: int = ALPHA) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.02)
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = _zoo.build_hf(
        LlamaConfig, LlamaForCausalLM, **_zoo.decoder_config(attention_dropout=0.0)
    )
    model.requires_grad_(False)
    for layer in model.model.layers:
        attention = layer.self_attn
        attention.q_proj = LoRALinear(attention.q_proj)
        attention.v_proj = LoRALinear(attention.v_proj)
    return model
