"""Mamba-2 (Mamba2ForCausalLM, unwrapped): state-space duality, multi-head SSM with grouped B/C, a gated
RMSNorm; transformers' reference PyTorch path (chunked scan, no ``mamba_ssm`` kernels on the CPU).
No dropout."""

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
    from transformers import Mamba2Config, Mamba2ForCausalLM

    return _zoo.build_hf(
        Mamba2Config,
        Mamba2ForCausalLM,
        vocab_size=_zoo.VOCAB,
        hidden_size=32,
        state_size=8,
        num_heads=8,
        head_dim=8,
        n_groups=2,
        expand=2,
        num_hidden_layers=4,
        conv_kernel=4,
        chunk_size=8,
        time_step_rank=4,
        tie_word_embeddings=False,
    )
