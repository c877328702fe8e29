"""The seed document's manual partitioning example: nested ``smp.partition`` blocks in ``__init__``.

The innermost block wins; modules outside every block go to ``default_partition``.
The forward visits the children in an order where data only flows to later
partitions (child0, child2 on 0; child1, child3 on 1), which a pipeline needs.
Run::

    torchrun --nproc-per-node 2 examples/seed_scripts/manual_partition.py
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe as smp  # was: import smdistributed.modelparallel.torch as smp

CONFIG = {
    "partitions": 2,
    "microbatches": 2,
    "pipeline": "simple",
    "auto_partition": False,
    "default_partition": 1,
}


def child(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.Tanh())


class Model(torch.nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        with smp.partition(0):
            self.child0 = child(width)  # child0 on partition 0
            with smp.partition(1):
                self.child1 = child(width)  # child1 on partition 1
            self.child2 = child(width)  # child2 on partition 0
        self.child3 = nn.Linear(width, 4)  # child3 on default_partition (1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child3(self.child1(self.child2(self.child0(x))))


@smp.step
def train_step(model, data, target):
    loss = F.cross_entropy(model(data), target)
    model.backward(loss)
    return loss


def data(
    steps: int, batch_size: int = 8, width: int = 16
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (
            torch.randn(batch_size, width, generator=g),
            torch.randint(0, 4, (batch_size,), generator=g),
        )
        for _ in range(steps)
    ]


def main(config: dict[str, Any] | None = None, steps: int = 3) -> dict[str, Any]:
    smp.init(config or CONFIG)
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(optimizer)
    losses = []
    for x, y in data(steps):
        optimizer.zero_grad()
        losses.append(train_step(model, x, y).reduce_mean().item())
        optimizer.step()
    modules = sorted({name.split(".")[0] for name, _ in model.local_named_modules()})
    print(f"mp_rank {smp.mp_rank()} holds {modules}; losses {[round(v, 4) for v in losses]}")
    return {"losses": losses, "modules": modules, "state_dict": model.state_dict()}


if __name__ == "__main__":
    main()
