"""T5 (T5ForConditionalGeneration, unwrapped: Seq2SeqLMOutput): encoder-decoder, relative position buckets, RMS-style LayerNorm, tied embeddings scaled at the head. Dropout 0.1.

Positional call: (input_ids, attention_mask, decoder_input_ids). With labels= the model builds decoder_input_ids itself by shifting the labels right."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))  # for _zoo.py next to this file

import _zoo  # noqa: E402
from _zoo import seq2seq_targets as example_targets, token_loss as loss_fn  # noqa: E402,F401

DROPOUT = True
KWARGS_ONLY = False  # forward(input_ids, attention_mask, decoder_input_ids, ...)


def build_model():
    from transformers import T5Config, T5ForConditionalGeneration

    return _zoo.build_hf(
        T5Config,
        T5ForConditionalGeneration,
        vocab_size=_zoo.VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.1,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )


example_inputs = partial(_zoo.seq2seq_inputs, decoder_start=0)
example_kwargs = partial(_zoo.seq2seq_kwargs, decoder_start=0)
example_kwargs_labels = partial(_zoo.seq2seq_kwargs, decoder_start=0, labels=True)
