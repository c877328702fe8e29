"""FairScale's FullyShardedDataParallel example: parameters sharded too (ZeRO-3).

Only the import differs from FairScale's text (was ``from fairscale.nn.data_parallel
import FullyShardedDataParallel as FSDP``). FairScale's text never builds the optimizer
it steps; here it is built over the wrapped model's parameters, as FSDP requires.
``python examples/fairscale_scripts/fsdp.py`` trains it on 2 ranks and checks it against
plain DDP.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

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

from fxpipe.sharding import FullyShardedDataParallel as FSDP  # noqa: E402


def train(rank: int, world_size: int, epochs: int) -> dict[str, Any]:
    # process group init
    dist_init(rank, world_size)

    # Problem statement
    model = myAwesomeModel()
    dataloader = mySuperFastDataloader

    # optimizer specific arguments e.g. LR, momentum, etc...
    base_optimizer_arguments = {"lr": 1e-2}

    # Wrap a base optimizer into OSS
    base_optimizer = torch.optim.SGD  # any pytorch compliant optimizer

    # Wrap the model into FSDP, which will reduce parameters to the proper ranks
    model = FSDP(model)
    optimizer = base_optimizer(model.parameters(), **base_optimizer_arguments)

    # Any relevant training loop. For example:
    losses = []
    model.train()
    for e in range(epochs):
        for data, target in dataloader(rank, e):
            model.zero_grad()
            outputs = model(data)
            loss = loss_fn(outputs, target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return {"losses": losses, "state": full_state(model)}


def main() -> None:
    check_against_ddp("FSDP", spawn(train, EPOCHS), spawn(train_ddp, EPOCHS))


if __name__ == "__main__":
    main()
