"""Tiny Hugging Face models built from configs (no download), for tests and benchmarks.

``build_model`` / ``example_inputs`` make this a model file for GPT-2 (logits out);
``build_bert`` / ``bert_inputs`` give a BERT encoder taking ``input_ids`` and
``attention_mask`` whose output is the model's own ``ModelOutput``. All dropout
probabilities are 0 so outputs are deterministic in train mode too.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 64
SEQ = 16


class GPT2Logits(nn.Module):
    """``GPT2LMHeadModel`` without a KV cache, returning only the logits tensor."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, use_cache=False).logits


def build_gpt2(
    layers: int = 2, width: int = 32, heads: int = 4, vocab: int = VOCAB, positions: int = 32
) -> nn.Module:
    """A randomly initialised GPT-2 LM (tied wte/lm_head) wrapped to return logits."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab,
        n_positions=positions,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2Logits(GPT2LMHeadModel(config))


def build_gpt2_small() -> nn.Module:
    """GPT-2 small's shape (12 layers, width 768, 50257 tokens), random weights."""
    return build_gpt2(layers=12, width=768, heads=12, vocab=50257, positions=1024)


def build_bert(layers: int = 2, width: int = 32, heads: int = 4, vocab: int = VOCAB) -> nn.Module:
    """A randomly initialised ``BertModel`` (with pooler) and no dropout."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=vocab,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * width,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertModel(config)


def build_model() -> nn.Module:
    return build_gpt2()


def example_inputs(batch_size: int, seq: int = SEQ, vocab: int = VOCAB) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, vocab, (batch_size, seq), generator=g),)


def bert_inputs(batch_size: int, seq: int = SEQ) -> tuple[torch.Tensor, ...]:
    """``input_ids`` and an ``attention_mask`` whose last sample pads its final quarter."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch_size, seq), generator=g)
    mask = torch.ones(batch_size, seq, dtype=torch.long)
    mask[-1, seq - seq // 4 :] = 0
    return ids, mask


def gpt2_small_inputs(batch_size: int, seq: int = 128) -> tuple[torch.Tensor, ...]:
    return example_inputs(batch_size, seq=seq, vocab=50257)


def example_targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.size(-1)), target.reshape(-1))
