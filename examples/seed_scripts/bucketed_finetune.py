"""Fine-tune a small language model on length-bucketed text, one pipeline build for every length.

The text (a few lines, bundled below, tokenized by character) is sorted into length buckets, each
batch padded only to the longest line of its bucket: every step has another sequence length
(here 24, 40, 56, 32, ...) and no step pays for the padding of the longest line in the data.
``DistributedModel(..., dynamic_dims=...)`` declares the sequence dimension dynamic, so the build
made at the first step runs every length in its range (docs/shapes.md): no retrace, no rebuild.
Pads are on the right, with the label ``-100`` (the model ignores them in its loss; causal
attention keeps them from changing the real tokens), so no attention mask is needed.

Run it on 2 processes (one pipeline stage each, gloo on CPU)::

    torchrun --standalone --nproc-per-node 2 examples/seed_scripts/bucketed_finetune.py --steps 8

``--init model.pt`` starts from a state dict (a checkpoint to fine-tune); without it the tiny
model starts from its seeded initialisation.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn as nn

import fxpipe as smp

TEXT = """\
The sea was calm that morning.
A gull rose from the harbour wall and wheeled over the boats.
Nets lay drying on the stones.
The old keeper climbed the stair of the lighthouse, as he had done for forty years, and wound the clock.
Far out, a sail.
Children ran along the sand with a kite that would not fly.
By noon the wind had turned, and the kite rose at last above the dunes and the grey roofs of the town.
Rain came in the evening.
Lamps were lit in every window along the quay.
The fishermen came home, their boats low in the water, and the market stayed open late into the night.
Nobody slept much.
In the morning the sea was calm again, and the gulls were back on the harbour wall.
"""
PAD, BUCKET = 0, 16  # bucket width: a batch is padded to the next multiple of 16 at most
MAX_LEN = 112
VOCAB = 128  # characters (ASCII), 0 the pad


def build_model() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LEN,
        tie_word_embeddings=True,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


# the sequence dimension follows the data (docs/shapes.md); the batch dimension always does
DYNAMIC_DIMS: dict[str, Any] = {
    "input_ids": {1: ("seq", 2, MAX_LEN)},
    "labels": {1: ("seq", 2, MAX_LEN)},
}


def buckets() -> dict[int, list[list[int]]]:
    """The lines as character ids, by bucket: the padded length of their batch."""
    out: dict[int, list[list[int]]] = {}
    for line in TEXT.splitlines():
        ids = [min(ord(c), VOCAB - 1) for c in line]
        width = min(MAX_LEN, -(-len(ids) // BUCKET) * BUCKET)
        out.setdefault(width, []).append(ids[:width])
    return dict(sorted(out.items()))


def batches(steps: int, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """``steps`` batches, each from one bucket in turn (``batch_size`` lines, drawn with repeats), padded
    on the right to the longest line in the batch: ``input_ids`` and ``labels`` (-100 at the pads)."""
    by_width = list(buckets().values())
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        lines = by_width[step % len(by_width)]
        picked = [lines[int(i)] for i in torch.randint(len(lines), (batch_size,), generator=g)]
        length = max(len(ids) for ids in picked)
        ids = torch.full((batch_size, length), PAD, dtype=torch.long)
        labels = torch.full((batch_size, length), -100, dtype=torch.long)
        for row, line in enumerate(picked):
            ids[row, : len(line)] = torch.tensor(line)
            labels[row, : len(line)] = torch.tensor(line)
        out.append({"input_ids": ids, "labels": labels})
    return out


@smp.step
def train_step(model, batch):
    out = model(**batch)
    model.backward(out.loss)
    return out.loss


def main(
    config: dict[str, Any] | None = None,
    steps: int = 8,
    batch_size: int = 4,
    lr: float = 0.05,
    init: str | None = None,
) -> dict[str, Any]:
    smp.init(config or {"partitions": 2, "microbatches": 2})
    torch.manual_seed(0)
    net = build_model()
    if init is not None:
        net.load_state_dict(torch.load(init, weights_only=True))
    model = smp.DistributedModel(net, dynamic_dims=DYNAMIC_DIMS)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr))
    model.train()
    losses, lengths = [], []
    for batch in batches(steps, batch_size):
        optimizer.zero_grad()
        loss_mb = train_step(model, batch)
        optimizer.step()
        losses.append(loss_mb.reduce_mean().item())
        lengths.append(batch["input_ids"].shape[1])
        if smp.rank() == 0:
            print(f"step {len(losses)}: length {lengths[-1]}, loss {losses[-1]:.4f}", flush=True)
    return {"losses": losses, "lengths": lengths, "state_dict": model.state_dict()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--init", default=None, help="a state dict to fine-tune from")
    args = parser.parse_args()
    main(steps=args.steps, init=args.init)
