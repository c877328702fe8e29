"""The seed API's ``shard`` key on 4 ranks (2 partitions x 2 replicas): FSDP per stage.

``fxpipe.init({..., "ddp": True, "shard": "grad-op" | "full"})`` shards every stage over
its data-parallel group. Training with the user's own Adam equals one process on the
concatenated batch; ``model.state_dict()`` and ``optimizer.state_dict()`` are whole (the
shards gathered), and a checkpoint of ``local_state_dict()`` taken on every rank and saved
on ``dp_rank() == 0`` resumes onto the uninterrupted trajectory.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

import fxpipe.smp as api
from concat_reference import train_on_concatenated_batches
from dpscenarios import BASE, MICROBATCHES, REPLICAS, PARTITIONS, batch, build, loss_fn, train_step
from spawn import spawn

LEVELS = ("grad-op", "full")
LR, STEPS, SPLIT = 0.02, 4, 2


def _session(level: str, seed: int = 0) -> tuple[Any, Any]:
    api.init({**BASE, "shard": level})
    model = api.DistributedModel(build(seed), trace_device="cpu")
    return model, api.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=LR))


def _train(model: Any, opt: Any, steps: range) -> list[float]:
    losses = []
    for k in steps:
        opt.zero_grad()
        losses.append(train_step(model, *batch(k, api.dp_rank())).reduce_mean().item())
        opt.step()
    return losses


def _job(rank: int, world: int, directory: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for level in LEVELS:
        model, opt = _session(level)
        losses = _train(model, opt, range(STEPS))
        sharded = all(isinstance(p, DTensor) for p in model.local_parameters())
        out[level] = {
            "losses": losses,
            "state": model.state_dict(),
            "optimizer": opt.state_dict(),
            "sharded": sharded,
        }
        api.shutdown(destroy_process_group=False)

        model, opt = _session(level)
        _train(model, opt, range(SPLIT))
        checkpoint = {
            "model": model.local_state_dict(),
            "optimizer": opt.local_state_dict(),
        }  # collective
        if api.dp_rank() == 0:
            api.save(checkpoint, f"{directory}/{level}.pt", partial=True)
        api.barrier()
        api.shutdown(destroy_process_group=False)

        model, opt = _session(level, seed=1234)  # other weights, overwritten by the checkpoint
        ckpt = api.load(f"{directory}/{level}.pt", partial=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        _train(model, opt, range(SPLIT, STEPS))
        out[level]["resumed"] = model.state_dict()
        api.shutdown(destroy_process_group=False)
    return out


def reference(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    return train_on_concatenated_batches(
        copy.deepcopy(build(0)),
        batch,
        steps,
        REPLICAS,
        MICROBATCHES,
        loss_fn,
        lambda p: torch.optim.Adam(p, lr=LR),
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("seed_shard")
    return [r.value for r in spawn(_job, PARTITIONS * REPLICAS, str(directory), timeout=400)]


@pytest.mark.distributed
@pytest.mark.slow
def test_seed_api_shard_levels_equal_one_process_adam(results: list[dict[str, Any]]) -> None:
    losses, state = reference(STEPS)
    for level in LEVELS:
        mean = torch.tensor(
            [results[r * PARTITIONS][level]["losses"] for r in range(REPLICAS)]
        ).mean(0)
        torch.testing.assert_close(mean, torch.tensor(losses), rtol=1e-5, atol=1e-6, msg=level)
        for rank, res in enumerate(results):
            got = res[level]
            assert got["sharded"], (level, rank)
            assert list(got["state"]) == list(state)
            torch.testing.assert_close(
                got["state"], state, rtol=1e-5, atol=1e-6, msg=f"{level} rank {rank}"
            )
            # the whole optimizer state: every parameter's Adam moments, unsharded
            assert all(
                s["exp_avg"].shape == p.shape
                for s, p in zip(got["optimizer"]["state"].values(), state.values())
                if p.dim()
            )


@pytest.mark.distributed
@pytest.mark.slow
def test_seed_api_sharded_checkpoint_resumes_the_same_trajectory(
    results: list[dict[str, Any]],
) -> None:
    for level in LEVELS:
        for rank, res in enumerate(results):
            torch.testing.assert_close(
                res[level]["resumed"],
                res[level]["state"],
                rtol=0,
                atol=0,
                msg=f"{level} rank {rank}",
            )
