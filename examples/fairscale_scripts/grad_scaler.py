"""FairScale's mixed-precision example: OSS + ShardedDDP with a ShardedGradScaler under autocast.

Only the imports differ from FairScale's text (was ``from fairscale.optim.grad_scaler import
ShardedGradScaler``, ``from fairscale.optim.oss import OSS`` and ``from
fairscale.nn.data_parallel import ShardedDataParallel as ShardedDDP``); the CPU's
``torch.autocast("cpu", dtype=torch.float16)`` stands in for CUDA's ``autocast()``.
``python examples/fairscale_scripts/grad_scaler.py`` trains it on 2 ranks and checks it
against the same loop under plain DDP with ``torch.amp.GradScaler``; with ``--overflow``
rank 1 alone injects an infinite gradient in the first step, and every rank must skip
that step and halve its scale.
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

from fxpipe.sharding import OSS, ShardedGradScaler  # noqa: E402
from fxpipe.sharding import ShardedDataParallel as ShardedDDP  # noqa: E402


def train(rank: int, world_size: int, epochs: int, overflow: bool = False) -> dict[str, Any]:
    dist_init(rank, world_size)

    # Creates model and optimizer in default precision
    model = myAwesomeModel()
    optimizer = OSS(params=model.parameters(), optim=torch.optim.SGD, lr=1e-2)
    model = ShardedDDP(model, optimizer)

    # Creates a ShardedGradScaler once at the beginning of training.
    scaler = ShardedGradScaler()

    losses, scales = [], []
    for epoch in range(epochs):
        for input, target in mySuperFastDataloader(rank, epoch):
            optimizer.zero_grad()

            # Runs the forward pass with autocasting.
            with torch.autocast("cpu", dtype=torch.float16):
                output = model(input)
                loss = loss_fn(output, target)

            # Scales loss.  Calls backward() on scaled loss to create scaled gradients.
            scaler.scale(loss).backward()
            if (
                overflow and rank == 1 and not scales
            ):  # this rank's shard of the gradients overflows
                next(p for p in model.parameters() if p.grad is not None).grad.to_local().fill_(
                    float("inf")
                )

            # scaler.step() first unscales the gradients of the optimizer's assigned params.
            # If these gradients do not contain infs or NaNs, optimizer.step() is then called,
            # otherwise, optimizer.step() is skipped.
            scaler.step(optimizer)

            # Updates the scale for next iteration.
            scaler.update()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
    return {"losses": losses, "state": full_state(model), "scales": scales}


def main() -> None:
    if "--overflow" in sys.argv:
        results = spawn(train, EPOCHS, True)
        print("scales per step:", [r["scales"] for r in results])
        return
    check_against_ddp(
        "OSS + ShardedDDP + ShardedGradScaler (autocast float16)",
        spawn(train, EPOCHS),
        spawn(train_ddp, EPOCHS, torch.optim.SGD, True),
        rtol=1e-3,
        atol=1e-4,
    )


if __name__ == "__main__":
    main()
