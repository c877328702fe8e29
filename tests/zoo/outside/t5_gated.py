"""T5 v1.1 / Flan style: gated-gelu feed-forward, untied head, labels= call (the model builds decoder inputs)."""

import torch
from transformers import T5Config, T5ForConditionalGeneration


def build_model():
    torch.manual_seed(0)
    cfg = T5Config(
        vocab_size=128,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=3,
        num_heads=4,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        dropout_rate=0.1,
        use_cache=False,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return T5ForConditionalGeneration(cfg)


def example_inputs(batch_size):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (batch_size, 12), generator=g)
    labels = torch.randint(1, 128, (batch_size, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, -4:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
