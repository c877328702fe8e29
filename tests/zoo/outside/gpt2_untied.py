"""A new user's GPT-2 variant: untied LM head, layer-idx attention scaling, upcast attention, labels= call."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def build_model():
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=128,
        n_positions=64,
        n_embd=48,
        n_layer=4,
        n_head=4,
        tie_word_embeddings=False,
        scale_attn_by_inverse_layer_idx=True,
        reorder_and_upcast_attn=True,
        use_cache=False,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
    )
    return GPT2LMHeadModel(cfg)


def example_inputs(batch_size):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (batch_size, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}
