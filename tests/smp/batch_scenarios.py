"""Rank functions for the seed API's batch and config agreement tests (importable by spawned children).

An MNIST-style loop: a ``DataLoader(shuffle=True)`` over a small learnable data set, a classifier
with or without dropout, ``@step`` over 4 microbatches, several epochs. A loader without a seeded
generator draws its shuffle seed from the global RNG at each epoch, and dropout draws from it on
the rank that holds the dropout layer only, so from the second epoch each rank's loader shuffles
differently (``drift`` draws on rank 1 the way dropout would, without changing the numerics).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import fxpipe.smp as api
from fxpipe.errors import FxpipeError

FEATURES, CLASSES, SAMPLES, BATCH, MICROBATCHES = 16, 4, 64, 16, 4


class Net(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 32)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(F.relu(self.fc1(x)))
        x = F.relu(self.fc2(x))
        return F.log_softmax(self.fc3(x), dim=1)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(1)
    return TensorDataset(x, y)


def loader(seeded: bool) -> DataLoader:
    generator = torch.Generator().manual_seed(5) if seeded else None
    return DataLoader(dataset(), batch_size=BATCH, shuffle=True, generator=generator)


@api.step
def train_step(
    model: Any, data: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    loss = F.nll_loss(model(data), target)
    model.backward(loss)
    return loss, target.sum()  # the targets the loss stage trained on


def train(epochs: int, dropout: float, seeded: bool, drift: bool) -> dict[str, Any]:
    """The loop on this rank: its losses, the loss stage's target sums, and this rank's own targets."""
    api.init({"partitions": 2, "microbatches": MICROBATCHES})
    torch.manual_seed(0)
    model = api.DistributedModel(Net(dropout))
    opt = api.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2))
    data = loader(seeded)
    out: dict[str, Any] = {"losses": [], "trained_target_sums": [], "own_targets": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(epochs):
            for x, y in data:
                opt.zero_grad()
                loss_mb, target_mb = train_step(model, x, y)
                opt.step()
                out["losses"].append(loss_mb.reduce_mean().item())
                out["trained_target_sums"].append([int(t) for t in target_mb])
                out["own_targets"].append(y.tolist())
            if drift and api.rank() == 1:
                torch.rand(7)  # what dropout on this rank's stage would draw
    out["warnings"] = [str(w.message) for w in caught if "first stage" in str(w.message)]
    api.shutdown(destroy_process_group=False)
    return out


def one_process(epochs: int, seeded: bool) -> list[float]:
    """The same loop in one process (no dropout)."""
    torch.manual_seed(0)
    model = Net(0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    data = loader(seeded)
    losses = []
    for _ in range(epochs):
        for x, y in data:
            opt.zero_grad()
            total = []
            for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
                loss = F.nll_loss(model(xm), ym)
                (loss / MICROBATCHES).backward()
                total.append(loss.detach())
            opt.step()
            losses.append(torch.stack(total).mean().item())
    return losses


def _error(call: Any) -> str:
    try:
        call()
        return "no error"
    except FxpipeError as exc:
        return f"{type(exc).__name__}: {exc}"


def config_errors(rank: int) -> dict[str, str]:
    """``init`` with a config that differs between the ranks, key by key."""
    out = {}
    for key, mine in [
        ("microbatches", {"microbatches": 4 if rank == 0 else 2}),
        ("pipeline", {"pipeline": "simple" if rank == 0 else "interleaved"}),
    ]:
        out[key] = _error(lambda: api.init({"partitions": 2, **mine}))
        api.shutdown(destroy_process_group=False)
    return out


@api.step
def echo_step(model: Any, data: torch.Tensor, extras: dict[str, Any]) -> dict[str, Any]:
    model(data)  # forward only
    return extras


def extras(rank: int) -> dict[str, Any]:
    """Tensors of every kind, with values of this rank's own (dim 0 of 2 rows, or no dim: passed whole)."""
    g = torch.Generator().manual_seed(10 + rank)
    return {
        "bool": torch.rand(2, 3, generator=g) > 0.5,
        "half": torch.randn(2, 5, generator=g).half(),
        "complex": torch.randn(2, 2, dtype=torch.complex64, generator=g),
        "scalar": torch.tensor(rank + 0.5),
        "empty": torch.zeros(2, 0),
        "strided": torch.randn(3, 2, generator=g).t(),
        "nan": torch.tensor([float("nan"), rank]),
        "bytes": torch.randint(0, 255, (2, 7), generator=g).byte(),
    }


def batch_mechanics(rank: int) -> dict[str, Any]:
    """What the loss stage receives of tensors of every kind; a step called with targets of another shape on rank 1."""
    api.init({"partitions": 2, "microbatches": 2})
    torch.manual_seed(0)
    model = api.DistributedModel(Net(0.0))
    x, y = dataset().tensors
    echoed = echo_step(model, x[:2], extras(rank))
    out = {
        "received": {k: [echoed[m][k] for m in range(2)] for k in echoed[0]},
        "mismatch": _error(lambda: train_step(model, x[:8], y[:8] if rank == 0 else y[:4])),
    }
    api.shutdown(destroy_process_group=False)
    return out


def job(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"config": config_errors(rank)}
    out["dropout"] = train(epochs=3, dropout=0.5, seeded=False, drift=False)
    out["drift"] = train(epochs=3, dropout=0.0, seeded=False, drift=True)
    out["seeded"] = train(epochs=3, dropout=0.0, seeded=True, drift=True)
    out["mechanics"] = batch_mechanics(rank)
    return out
