"""The seed document's training loop, ported by changing one line: ``import fxpipe as smp``.

Run on 2 processes (one pipeline stage each, gloo on CPU)::

    torchrun --nproc-per-node 2 examples/seed_scripts/train_loop.py --optimizer adam
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe as smp  # was: import smdistributed.modelparallel.torch as smp


class Net(nn.Module):
    """A small MNIST-style convolutional classifier (12x12 inputs to keep it quick)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.fc1 = nn.Linear(8 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def batches(steps: int, batch_size: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed synthetic data set (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch_size, 1, 12, 12, generator=g),
            torch.randint(0, 10, (batch_size,), generator=g),
        )
        for _ in range(steps)
    ]


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@smp.step
def train_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="mean")
    model.backward(loss)
    return output, loss


def train(model, train_loader, optimizer) -> list[float]:
    model.train()
    losses = []
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        _, loss_mb = train_step(model, data, target)
        # loss_mb holds the loss of every microbatch
        loss = loss_mb.reduce_mean()
        optimizer.step()
        losses.append(loss.item())
    return losses


@smp.step
def test_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="sum").item()  # sum up batch loss
    pred = output.argmax(dim=1, keepdim=True)  # get the index of the max log-probability
    correct = pred.eq(target.view_as(pred)).sum().item()
    return loss, correct


def test(model, test_loader) -> tuple[float, int]:
    model.eval()
    test_loss = 0.0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            loss_batch, correct_batch = test_step(model, data, target)
            test_loss += sum(loss_batch)
            correct += sum(correct_batch)
    return test_loss / sum(len(t) for _, t in test_loader), correct


def main(
    config: dict[str, Any] | None = None,
    optimizer_name: str = "sgd",
    steps: int = 4,
    batch_size: int = 8,
) -> dict[str, Any]:
    smp.init(config or {"partitions": 2, "microbatches": 4, "pipeline": "interleaved"})
    torch.manual_seed(0)
    model = Net()
    optimizer = make_optimizer(optimizer_name, model.parameters())
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(optimizer)
    losses = train(model, batches(steps, batch_size), optimizer)
    test_loss, correct = test(model, batches(2, batch_size, seed=2))
    if smp.rank() == 0:
        print(
            f"losses: {[round(x, 4) for x in losses]}; test loss {test_loss:.4f}, {correct} correct"
        )
    return {
        "losses": losses,
        "test": (test_loss, correct),
        "state_dict": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "local_keys": [k for k, _ in model.local_named_parameters()],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    parser.add_argument("--pipeline", choices=["simple", "interleaved"], default="interleaved")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    main(
        {"partitions": 2, "microbatches": 4, "pipeline": args.pipeline}, args.optimizer, args.steps
    )
