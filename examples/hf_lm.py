"""Hugging Face models as training loops call them: keyword inputs, ``labels=``, the model's own loss.

A model file with a dict-returning ``example_inputs`` and no ``loss_fn``: the model is
``GPT2LMHeadModel`` itself (unwrapped: its ``CausalLMOutputWithPast`` comes out), called
as ``model(input_ids=..., attention_mask=..., labels=...)``; it computes its loss from the
labels, and ``fxpipe run`` trains on that ``output.loss``. ``build_bart`` / ``bart_inputs``
give the same for an encoder-decoder (``BartForConditionalGeneration``; with ``labels=``
the model builds ``decoder_input_ids`` itself). Tiny configs, every dropout 0, so train
mode is deterministic; nothing is downloaded.

    fxpipe partition examples/hf_lm.py --stages 2 --out build && fxpipe verify build && fxpipe run build
"""

from __future__ import annotations

import torch
import torch.nn as nn

VOCAB = 64
SEQ = 12


def build_model() -> nn.Module:
    """A randomly initialised GPT-2 LM (2 layers, width 16, tied head), unwrapped."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    return GPT2LMHeadModel(config)


def build_bart() -> nn.Module:
    """A randomly initialised BART (1 + 1 layers, width 16), unwrapped."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=VOCAB,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        use_cache=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    return BartForConditionalGeneration(config)


def _ids(batch_size: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch_size, seq), generator=torch.Generator().manual_seed(seed))


def _mask(batch_size: int) -> torch.Tensor:
    """Ones, but the last sample pads its final quarter."""
    mask = torch.ones(batch_size, SEQ, dtype=torch.long)
    mask[-1, SEQ - SEQ // 4 :] = 0
    return mask


def example_inputs(batch_size: int) -> dict[str, torch.Tensor]:
    """The keyword call of a causal-LM training loop (the model shifts the labels itself)."""
    ids = _ids(batch_size, SEQ, 1)
    return {"input_ids": ids, "attention_mask": _mask(batch_size), "labels": ids.clone()}


def bart_inputs(batch_size: int) -> dict[str, torch.Tensor]:
    """Source ids and mask, and target ids as ``labels`` (8 tokens)."""
    return {
        "input_ids": _ids(batch_size, SEQ, 1),
        "attention_mask": _mask(batch_size),
        "labels": _ids(batch_size, 8, 2),
    }
