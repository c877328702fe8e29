"""BART (BartForConditionalGeneration, unwrapped: Seq2SeqLMOutput): encoder-decoder, learned positions offset by 2, tied embeddings, final_logits_bias buffer. Dropout 0.1 (hidden, attention, activation).

Positional call: (input_ids, attention_mask, decoder_input_ids). With labels= the model builds decoder_input_ids itself."""

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
DECODER_START = 2


def build_model():
    from transformers import BartConfig, BartForConditionalGeneration

    return _zoo.build_hf(
        BartConfig,
        BartForConditionalGeneration,
        vocab_size=_zoo.VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        dropout=0.1,
        attention_dropout=0.1,
        activation_dropout=0.1,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=DECODER_START,
        forced_eos_token_id=2,
    )


example_inputs = partial(_zoo.seq2seq_inputs, decoder_start=DECODER_START)
example_kwargs = partial(_zoo.seq2seq_kwargs, decoder_start=DECODER_START)
example_kwargs_labels = partial(_zoo.seq2seq_kwargs, decoder_start=DECODER_START, labels=True)
