"""WavLM for CTC as a user writes it: relative position buckets, gated attention, SpecAugment on
(transformers' default time masks), raw audio and character labels, trained on its own CTC loss.

The third speech encoder whose masks are drawn at run time (Note [masks drawn on the host]):
nothing in fxpipe names WavLM."""

import torch
from transformers import WavLMConfig, WavLMForCTC


def build_model():
    torch.manual_seed(0)
    cfg = WavLMConfig(
        vocab_size=12,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4,
        num_buckets=8,
        max_bucket_distance=20,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        feat_proj_dropout=0.0,
        final_dropout=0.0,
        layerdrop=0.0,
        mask_time_prob=0.05,
        pad_token_id=0,
    )
    return WavLMForCTC(cfg).train()


def example_inputs(batch_size):
    g = torch.Generator().manual_seed(3)
    audio = torch.randn(batch_size, 400, generator=g)
    labels = torch.randint(1, 12, (batch_size, 6), generator=g)
    return {"input_values": audio, "labels": labels}
