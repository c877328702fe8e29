"""What FairScale's examples leave to the reader (``dist_init``, ``myAwesomeModel``,
``mySuperFastDataloader``), and the plain-DDP loop every ported script is checked against.

Each script in this folder is one of FairScale's documented examples with its imports
changed to ``fxpipe.sharding``; ``python examples/fairscale_scripts/<script>.py`` trains
it on 2 CPU ranks (gloo) and checks that it ends where the same loop under plain
``DistributedDataParallel`` ends.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORLD_SIZE, EPOCHS, BATCH, STEPS_PER_EPOCH = 2, 2, 8, 3


def dist_init(rank: int, world_size: int) -> None:
    """Join the gloo group on this machine (torchrun's variables when set, else the launcher's)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    torch.manual_seed(0)  # every rank builds the same initial model
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def myAwesomeModel() -> nn.Module:  # noqa: N802 - FairScale's example name
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def mySuperFastDataloader(rank: int, epoch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # noqa: N802
    """This rank's batches of one epoch (each rank its own data, as a DistributedSampler gives)."""
    g = torch.Generator().manual_seed(1000 * epoch + rank)
    for _ in range(STEPS_PER_EPOCH):
        yield torch.randn(BATCH, 16, generator=g), torch.randint(0, 4, (BATCH,), generator=g)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.float(), target)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole weights under its own keys (a sharded model gathers them; DDP's prefix dropped)."""
    sd = model.state_dict()
    return {
        k.removeprefix("module."): (v.full_tensor() if hasattr(v, "full_tensor") else v)
        .detach()
        .cpu()
        .clone()
        for k, v in sd.items()
    }


def train_ddp(
    rank: int,
    world_size: int,
    epochs: int,
    optim: type[torch.optim.Optimizer] = torch.optim.SGD,
    amp: bool = False,
    **optim_args: Any,
) -> dict[str, Any]:
    """The reference: the same loop under plain DistributedDataParallel."""
    dist_init(rank, world_size)
    model = DDP(myAwesomeModel())
    optimizer = optim(model.parameters(), **(optim_args or {"lr": 1e-2}))
    scaler = torch.amp.GradScaler("cpu") if amp else None
    losses = []
    model.train()
    for e in range(epochs):
        for data, target in mySuperFastDataloader(rank, e):
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                loss = loss_fn(model(data), target)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            losses.append(loss.item())
    out = {"losses": losses, "state": full_state(model)}
    dist.destroy_process_group()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, fn: Callable[..., dict[str, Any]], args: tuple[Any, ...], out: str) -> None:
    torch.save(fn(rank, *args), f"{out}/rank_{rank}.pt")


def spawn(fn: Callable[..., dict[str, Any]], *args: Any) -> list[dict[str, Any]]:
    """``fn(rank, WORLD_SIZE, *args)`` on WORLD_SIZE processes (``mp.spawn``), each rank's result."""
    os.environ["MASTER_PORT"] = str(_free_port())
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(fn, (WORLD_SIZE, *args), out), nprocs=WORLD_SIZE, join=True)
        return [torch.load(f"{out}/rank_{r}.pt", weights_only=True) for r in range(WORLD_SIZE)]


def check_against_ddp(
    name: str,
    results: list[dict[str, Any]],
    reference: list[dict[str, Any]],
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """Every rank's weights equal plain DDP's after the same training; print the losses."""
    for rank, (got, want) in enumerate(zip(results, reference)):
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=rtol, atol=atol
        )
        for key, value in want["state"].items():
            torch.testing.assert_close(
                got["state"][key], value, rtol=rtol, atol=atol, msg=f"{key} on rank {rank}"
            )
    print(
        f"{name}: losses {[round(x, 4) for x in results[0]['losses']]} equal plain DDP's on {WORLD_SIZE} ranks"
    )
