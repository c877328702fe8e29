"""A Hugging Face training loop on the seed API: ``model(**batch)`` with ``labels``, ``model.backward(out.loss)``.

The model is ``GPT2LMHeadModel`` itself (tiny, random weights, no dropout, nothing downloaded):
it takes the batch as keyword arguments and computes its own loss from ``labels=``, exactly as
in a one-device loop. Run on 2 processes (one pipeline stage each, gloo on CPU)::

    torchrun --nproc-per-node 2 examples/seed_scripts/hf_keywords.py
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn as nn

import fxpipe as smp

VOCAB, SEQ = 64, 12


def build_model() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

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


def batches(steps: int, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Token batches as a data loader gives them (two, in turn): ``input_ids``, a padding
    ``attention_mask`` and ``labels`` (the ids: the model shifts them itself)."""
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(2):
        ids = torch.randint(3, VOCAB, (batch_size, SEQ), generator=g)
        mask = torch.ones(batch_size, SEQ, dtype=torch.long)
        mask[-1, SEQ - 3 :] = 0
        data.append({"input_ids": ids, "attention_mask": mask, "labels": ids})
    return [data[i % 2] for i in range(steps)]


@smp.step
def train_step(model, batch):
    out = model(**batch)
    model.backward(out.loss)
    return out.loss


def main(
    config: dict[str, Any] | None = None, steps: int = 3, batch_size: int = 4
) -> dict[str, Any]:
    smp.init(config or {"partitions": 2, "microbatches": 2})
    torch.manual_seed(0)
    model = smp.DistributedModel(build_model())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    model.train()
    losses = []
    for batch in batches(steps, batch_size):
        optimizer.zero_grad()
        loss_mb = train_step(model, batch)
        optimizer.step()
        losses.append(loss_mb.reduce_mean().item())
    if smp.rank() == 0:
        print(f"losses: {[round(x, 4) for x in losses]}")
    return {"losses": losses, "state_dict": model.state_dict()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    main(steps=parser.parse_args().steps)
