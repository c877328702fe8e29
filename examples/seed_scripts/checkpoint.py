"""The seed document's checkpoint example: partial and full saves, then loading and training on.

Run the first job, then resume from either checkpoint in a second one::

    torchrun --nproc-per-node 2 examples/seed_scripts/checkpoint.py --dir /tmp/ckpt
    torchrun --nproc-per-node 2 examples/seed_scripts/checkpoint.py --dir /tmp/ckpt --resume partial
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe as smp  # was: import smdistributed.modelparallel.torch as smp

CONFIG = {"partitions": 2, "microbatches": 2, "pipeline": "interleaved"}


class MyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 24), nn.ReLU())
        self.head = nn.Linear(24, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


@smp.step
def train_step(model, data, target):
    loss = F.cross_entropy(model(data), target)
    model.backward(loss)
    return loss


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)


def setup(seed: int) -> tuple[Any, Any]:
    # Original model and optimizer
    torch.manual_seed(seed)
    model = MyModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    # model parallel wrapper
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(optimizer)
    return model, optimizer


def train(model: Any, optimizer: Any, first: int, steps: int) -> list[float]:
    losses = []
    for i in range(first, first + steps):
        optimizer.zero_grad()
        losses.append(train_step(model, *batch(i)).reduce_mean().item())
        optimizer.step()
    return losses


def save_checkpoints(model: Any, optimizer: Any, directory: str) -> None:
    # To save, always save on dp_rank 0 to avoid data racing
    if smp.dp_rank() == 0:
        # the library creates `checkpoint.pt_{mp_rank}` for each mp rank
        model_dict = model.local_state_dict()  # save the partial model
        opt_dict = optimizer.local_state_dict()  # save the partial optimizer state
        smp.save(
            {"model_state_dict": model_dict, "optimizer_state_dict": opt_dict},
            os.path.join(directory, "partial.pt"),
            partial=True,
        )
    # To save the full model
    if smp.dp_rank() == 0:
        model_dict = model.state_dict()  # save the full model
        opt_dict = optimizer.state_dict()  # save the full optimizer state
        smp.save(
            {"model_state_dict": model_dict, "optimizer_state_dict": opt_dict},
            os.path.join(directory, "full.pt"),
            partial=False,
        )
    smp.barrier()


def run_and_save(directory: str, before: int = 2, after: int = 2) -> list[float]:
    """Train ``before`` steps, save both checkpoints, train ``after`` more: the run that never stopped."""
    smp.init(CONFIG)
    model, optimizer = setup(seed=0)
    losses = train(model, optimizer, 0, before)
    save_checkpoints(model, optimizer, directory)
    return losses + train(model, optimizer, before, after)


def resume(directory: str, partial: bool, before: int = 2, after: int = 2) -> list[float]:
    """A fresh model (other initial weights) loads a checkpoint and trains the remaining steps."""
    smp.init(CONFIG)
    model, optimizer = setup(seed=1234)
    # To load, load on all ranks; only the partial flag differs
    name = "partial.pt" if partial else "full.pt"
    checkpoint = smp.load(os.path.join(directory, name), partial=partial)
    model.load_state_dict(checkpoint["model_state_dict"])
    optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
    return train(model, optimizer, before, after)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--resume", choices=["partial", "full"])
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    if args.resume:
        print("resumed losses:", resume(args.dir, args.resume == "partial"))
    else:
        print("losses:", run_and_save(args.dir))
