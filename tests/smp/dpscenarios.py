"""The seed API with data parallelism: the model, its one-process oracle and the 4-rank job's scenarios.

Every scenario runs through ``import fxpipe as smp`` calls only (``init`` with
``ddp: True``, ``DistributedModel``, ``@step``, ``DistributedOptimizer``, ``save``/``load``,
``amp.GradScaler``) in one spawned job of 2 partitions x 2 replicas, one after
another (``shutdown(destroy_process_group=False)`` between them).
"""

from __future__ import annotations

import json

import copy
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fxpipe.smp as api
from fxpipe.smp.amp import GradScaler
from fxpipe.smp.optimizer import sharded_optimizer
from fxpipe.runtime.dataparallel import optimizer_state_bytes

VOCAB, WIDTH, SEQ = 11, 8, 4
PARTITIONS, REPLICAS, MICROBATCHES, BATCH, LR = 2, 2, 2, 4, 0.5
BASE = {"partitions": PARTITIONS, "microbatches": MICROBATCHES, "ddp": True}
RESUME_SPLIT, RESUME_STEPS = 3, 6


class TiedLM(nn.Module):
    """Embedding tied to the output projection: the partitioner puts the two uses on different stages."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.l1 = nn.Linear(WIDTH, WIDTH)
        self.l2 = nn.Linear(WIDTH, WIDTH)
        self.l3 = nn.Linear(WIDTH, WIDTH)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l2(torch.tanh(self.l1(self.emb(idx)))))
        return torch.tanh(self.l3(h)) @ self.emb.weight.t()


def build(seed: int = 0) -> TiedLM:
    torch.manual_seed(seed)
    return TiedLM()


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.size(-1)).float(), target.reshape(-1))


def batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``replica``'s batch of step ``step`` (different data on every replica)."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(
        0, VOCAB, (BATCH, SEQ), generator=g
    )


def sgd(params: Any, momentum: float = 0.9) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=LR, momentum=momentum)


def reference(
    steps: int, every: int = 1, autocast: bool = False
) -> tuple[list[float], dict[str, Any], dict]:
    """One process on the replicas' batches concatenated: the mean loss over replicas x microbatches."""
    model = copy.deepcopy(build(0)).train()
    opt = sgd(model.parameters())
    chunks, losses = REPLICAS * MICROBATCHES, []
    for k in range(steps):
        if k % every == 0:
            opt.zero_grad()
        parts = [batch(k, r) for r in range(REPLICAS)]
        idx, target = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        total = 0.0
        for x, y in zip(idx.chunk(chunks), target.chunk(chunks)):
            with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext():
                loss = loss_fn(model(x), y)
            (loss / chunks).backward()
            total += loss.item()
        losses.append(total / chunks)
        if (k + 1) % every == 0:
            opt.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, opt.state_dict()


@api.step
def train_step(
    model: Any, idx: torch.Tensor, target: torch.Tensor, scaler: Any = None, autocast: bool = False
) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext():
        loss = loss_fn(model(idx), target)
    model.backward(scaler.scale(loss) if scaler is not None else loss)
    return loss


def session(
    config: dict[str, Any] | None = None, seed: int = 0, momentum: float = 0.9, **model_options: Any
) -> tuple[Any, Any]:
    api.init({**BASE, **(config or {})})
    model = api.DistributedModel(build(seed), trace_device="cpu", **model_options)
    return model, api.DistributedOptimizer(sgd(model.parameters(), momentum))


def train(model: Any, opt: Any, steps: range, every: int = 1, **step_kwargs: Any) -> list[float]:
    losses = []
    for k in steps:
        if k % every == 0:
            opt.zero_grad()
        losses.append(
            train_step(model, *batch(k, api.dp_rank()), **step_kwargs).reduce_mean().item()
        )
        if (k + 1) % every == 0:
            opt.step()
    return losses


def _local_state(model: Any) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().clone()
        for k, v in model.local_state_dict().items()
        if isinstance(v, torch.Tensor)
    }


def _ranks() -> dict[str, Any]:
    groups = [api.get_world_process_group(), api.get_mp_process_group(), api.get_dp_process_group()]
    return {
        "rank": api.rank(),
        "size": api.size(),
        "mp_rank": api.mp_rank(),
        "mp_size": api.mp_size(),
        "dp_rank": api.dp_rank(),
        "dp_size": api.dp_size(),
        "group_sizes": [dist.get_world_size(g) for g in groups],
        "dp_peers": dist.get_process_group_ranks(groups[2]),
    }


def allreduce_and_zero(out: dict[str, Any], rank: int) -> None:
    """The same training unsharded and with ``shard_optimizer_state``; replica 1 starts from other weights."""
    for name, config in (("allreduce", {}), ("zero", {"shard_optimizer_state": True})):
        model, opt = session(
            config, seed=rank // PARTITIONS
        )  # DDP starts every replica from replica 0's
        out[name] = {
            "losses": train(model, opt, range(3)),
            "state": model.state_dict(),
            "optimizer": opt.state_dict(),
            "local": _local_state(model),
            "state_bytes": optimizer_state_bytes(sharded_optimizer(opt) or opt),
        }
        if name == "allreduce":
            out["ranks"] = _ranks()
            out["plan_cost"] = json.loads(model.plan.to_json())["cost"]
        # drop the (sharded) momentum, load the full state dict back, and take a 4th step
        full = opt.state_dict()
        zero = sharded_optimizer(opt)
        (zero.optim if zero is not None else opt).state.clear()
        opt.load_state_dict(full)
        train(model, opt, range(3, 4))
        out[name]["reloaded"] = _local_state(model)
        api.shutdown(destroy_process_group=False)


def custom_hook(out: dict[str, Any]) -> None:
    """``model.register_comm_hook`` before the first step: the user's hook (counting, then all-reducing) runs."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    calls = []

    def counting_hook(
        state, bucket
    ):  # unannotated: DDP checks real annotations, and these would be strings
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    model, opt = session()
    model.register_comm_hook(api.get_dp_process_group(), counting_hook)
    out["custom_hook"] = {
        "losses": train(model, opt, range(3)),
        "state": model.state_dict(),
        "calls": len(calls),
    }
    api.shutdown(destroy_process_group=False)


def accumulation(out: dict[str, Any]) -> None:
    """``backward_passes_per_step=2``: the replicas sync every second step; stepping in between is refused."""
    model, opt = session({"pipeline": "simple"}, backward_passes_per_step=2)
    opt.zero_grad()
    losses = [train_step(model, *batch(0, api.dp_rank())).reduce_mean().item()]
    try:
        opt.step()
        out["early_step"] = "no error"
    except api.StepError as exc:
        out["early_step"] = str(exc)
    losses.append(train_step(model, *batch(1, api.dp_rank())).reduce_mean().item())
    opt.step()
    losses += train(model, opt, range(2, 4), every=2)
    out["accumulate"] = {"losses": losses, "state": model.state_dict()}
    api.shutdown(destroy_process_group=False)


def powersgd_resume(out: dict[str, Any], directory: Path) -> None:
    """PowerSGD: a run checkpointed at step 3 (weights, momentum, hook state) resumes to the uninterrupted one."""
    config = {"comm_hook": "powersgd", "powersgd_rank": 1}
    model, opt = session(config)
    train(model, opt, range(RESUME_STEPS))
    uninterrupted = _local_state(model)
    api.shutdown(destroy_process_group=False)

    model, opt = session(config)
    train(model, opt, range(RESUME_SPLIT))
    # weights and optimizer from dp_rank 0 (as in the seed's docs); the hook state from every rank
    if api.dp_rank() == 0:
        api.save(
            {"model": model.local_state_dict(), "optimizer": opt.local_state_dict()},
            directory / "ckpt.pt",
            partial=True,
        )
    api.save(model.comm_hook_state_dict(), directory / f"hook.pt_{api.dp_rank()}", partial=True)
    hook_iter = model.replicas.stage.hook_state.iter
    api.barrier()
    api.shutdown(destroy_process_group=False)

    resumed = {}
    for restore_hook in (True, False):
        model, opt = session(
            config, seed=1234
        )  # other initial weights, overwritten by the checkpoint
        ckpt = api.load(directory / "ckpt.pt", partial=True)
        model.load_state_dict(ckpt["model"])  # before partitioning: applied at the first step
        opt.load_state_dict(ckpt["optimizer"])
        if restore_hook:
            model.load_comm_hook_state_dict(
                api.load(directory / f"hook.pt_{api.dp_rank()}", partial=True)
            )
        train(model, opt, range(RESUME_SPLIT, RESUME_STEPS))
        resumed[restore_hook] = _local_state(model)
        api.shutdown(destroy_process_group=False)
    out["resume"] = {
        "uninterrupted": uninterrupted,
        "resumed": resumed[True],
        "without_hook": resumed[False],
        "hook_iter": hook_iter,
    }


def grad_scaler(out: dict[str, Any]) -> None:
    """An inf written into one gradient on global rank 3 only: all 4 ranks skip the step and back off."""
    model, opt = session(momentum=0.0)
    scaler = GradScaler(init_scale=1024.0)
    record = []
    for k in range(3):
        opt.zero_grad()
        train_step(model, *batch(k, api.dp_rank()), scaler=scaler)
        if k == 1 and api.rank() == 3:
            next(model.local_parameters()).grad.view(-1)[0] = float("inf")
        before = [p.detach().clone() for p in model.local_parameters()]
        scaler.step(opt)
        scaler.update()
        record.append(
            {
                "stepped": any(
                    not torch.equal(b, p) for b, p in zip(before, model.local_parameters())
                ),
                "scale": scaler.get_scale(),
            }
        )
    out["scaler"] = record
    api.shutdown(destroy_process_group=False)


def autocast(out: dict[str, Any]) -> None:
    """The user's ``torch.autocast`` around ``model(...)`` covers the stage: its layers compute in bfloat16."""
    model, opt = session()
    dtypes: set[str] = set()

    def record(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        dtypes.add(str(output.dtype))

    model.register_post_partition_hook(
        lambda m: [
            mod.register_forward_hook(record)
            for mod in m.local_modules()
            if isinstance(mod, nn.Linear)
        ]
    )
    losses = train(model, opt, range(3), autocast=True)
    out["autocast"] = {"losses": losses, "dtypes": sorted(dtypes), "state": model.state_dict()}
    api.shutdown(destroy_process_group=False)


def join(out: dict[str, Any]) -> None:
    """``model.join()`` entered before partitioning, with a sharded optimizer: replica 0 runs 3 steps, replica 1 two."""
    model, opt = session({"shard_optimizer_state": True})
    with model.join():
        train(model, opt, range(3 if api.dp_rank() == 0 else 2))
    out["join"] = _local_state(model)
    api.shutdown(destroy_process_group=False)


def job(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Rank function of the one spawned job: every scenario in turn."""
    out: dict[str, Any] = {}
    allreduce_and_zero(out, rank)
    custom_hook(out)
    accumulation(out)
    powersgd_resume(out, Path(directory))
    grad_scaler(out)
    autocast(out)
    join(out)
    return out
