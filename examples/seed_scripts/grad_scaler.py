"""``smp.amp.GradScaler`` in a pipeline: an inf on any stage skips the step on every stage.

``inject_inf_at`` writes an inf into one gradient on mp_rank 0 only, after the
backward of that step; the scaler must skip the optimizer step on *both* stages and
halve its scale on both. Run::

    torchrun --nproc-per-node 2 examples/seed_scripts/grad_scaler.py
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe as smp  # was: import smdistributed.modelparallel.torch as smp


@smp.step
def train_step(model, scaler, data, target):
    loss = F.mse_loss(model(data), target)
    model.backward(scaler.scale(loss))
    return loss


def main(steps: int = 3, inject_inf_at: int = 1) -> dict[str, Any]:
    smp.init({"partitions": 2, "microbatches": 2})
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(optimizer)
    scaler = smp.amp.GradScaler(init_scale=1024.0)
    g = torch.Generator().manual_seed(5)
    record = []
    for i in range(steps):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        optimizer.zero_grad()
        loss = train_step(model, scaler, x, y).reduce_mean().item()
        if i == inject_inf_at and smp.mp_rank() == 0:
            next(model.local_parameters()).grad.view(-1)[0] = float("inf")
        before = [p.detach().clone() for p in model.local_parameters()]
        scaler.step(optimizer)
        scaler.update()
        changed = any(not torch.equal(b, p) for b, p in zip(before, model.local_parameters()))
        record.append({"loss": loss, "stepped": changed, "scale": scaler.get_scale()})
    print(f"mp_rank {smp.mp_rank()}: {record}")
    return {"record": record}


if __name__ == "__main__":
    main()
