"""FairScale's "Optimizer, Gradient and Model Sharding" example: OSS + ShardedDDP.

Only the imports differ from FairScale's text (was ``from fairscale.optim.oss import OSS``
and ``from fairscale.nn.data_parallel import ShardedDataParallel as ShardedDDP``).
``python examples/fairscale_scripts/oss_sharded_ddp.py`` trains it on 2 ranks and checks it
against plain DDP; ``--ddp`` uses DDP in place of ShardedDDP, as FairScale's text allows.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    EPOCHS,
    check_against_ddp,
    dist_init,
    full_state,
    loss_fn,
    myAwesomeModel,  # noqa: E402
    mySuperFastDataloader,
    spawn,
    train_ddp,
)

from fxpipe.sharding import OSS  # noqa: E402
from fxpipe.sharding import ShardedDataParallel as ShardedDDP  # noqa: E402


def train(rank: int, world_size: int, epochs: int, use_ddp: bool = False) -> dict[str, Any]:
    # process group init
    dist_init(rank, world_size)

    # Problem statement
    model = myAwesomeModel()
    dataloader = mySuperFastDataloader

    # optimizer specific arguments e.g. LR, momentum, etc...
    base_optimizer_arguments = {"lr": 1e-2}

    # Wrap a base optimizer into OSS
    base_optimizer = torch.optim.SGD  # any pytorch compliant optimizer
    optimizer = OSS(params=model.parameters(), optim=base_optimizer, **base_optimizer_arguments)

    # Wrap the model into ShardedDDP, which will reduce gradients to the proper ranks
    model = DDP(model) if use_ddp else ShardedDDP(model, optimizer)

    # Any relevant training loop, nothing specific to OSS. For example:
    losses = []
    model.train()
    for e in range(epochs):
        for data, target in dataloader(rank, e):
            # Train
            model.zero_grad()
            outputs = model(data)
            loss = loss_fn(outputs, target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return {"losses": losses, "state": full_state(model)}


def main() -> None:
    use_ddp = "--ddp" in sys.argv
    check_against_ddp(
        "OSS + " + ("DDP" if use_ddp else "ShardedDDP"),
        spawn(train, EPOCHS, use_ddp),
        spawn(train_ddp, EPOCHS),
    )


if __name__ == "__main__":
    main()
