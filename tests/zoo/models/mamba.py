"""Mamba (MambaForCausalLM, unwrapped: MambaCausalLMOutput): a selective state-space model, no attention.
Its selective scan runs transformers' reference PyTorch path (no ``mamba_ssm`` kernels on the CPU): a
Python loop over the sequence, unrolled by the trace. In train mode it also casts ``D`` and the
``dt_proj`` bias for the fused kernel it then does not call, so its train and eval graphs differ
(Note [eval-only nodes in shape propagation] in ``fxpipe.tracer.measure.shapes``). No dropout."""

from __future__ import annotations

import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))  # for _zoo.py next to this file

import _zoo  # noqa: E402
from _zoo import next_token_targets as example_targets, token_loss as loss_fn  # noqa: E402,F401

DROPOUT = False
KWARGS_ONLY = False


def example_inputs(batch_size: int) -> tuple:
    return (_zoo.token_ids(batch_size),)


def build_model():
    from transformers import MambaConfig, MambaForCausalLM

    return _zoo.build_hf(
        MambaConfig,
        MambaForCausalLM,
        vocab_size=_zoo.VOCAB,
        hidden_size=32,
        state_size=8,
        num_hidden_layers=4,
        expand=2,
        conv_kernel=4,
        time_step_rank=4,
    )
