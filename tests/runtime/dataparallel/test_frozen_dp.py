"""Frozen parameters under data parallelism (issue 37; Note [frozen parameters] in fxpipe.codegen.graph.ownership).

``blocks.BlockLM`` on 4 ranks (2 stages x 2 replicas) with one block frozen whole and, in another,
the Linear frozen beside a trainable LayerNorm (so a block policy puts frozen and trainable
parameters in one FSDP unit). DDP, ZeRO and FSDP2 each train like one process on the concatenated
batches (Adam); the frozen parameters stay as they were, get no gradient and no optimizer state.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import blocks
from concat_reference import train_on_concatenated_batches
from fxpipe.runtime import PipelineRunner
from fxpipe.runtime.dataparallel import DataParallelOptions
from fxpipe.runtime.dataparallel.state_dict import full_state_dicts
from spawn import spawn

STAGES, REPLICAS, BATCH, LR, STEPS = 2, 2, 4, 0.02, 2
FROZEN = ("blocks.1.norm.weight", "blocks.1.norm.bias", "blocks.1.fc.weight", "blocks.1.fc.bias")
FROZEN += ("blocks.2.fc.weight", "blocks.2.fc.bias")
LEVELS = {
    "ddp": DataParallelOptions(),
    "zero": DataParallelOptions(shard="optimizer"),
    "fsdp2": DataParallelOptions(shard="full", shard_wrap="block"),
}


def _frozen_reference() -> blocks.BlockLM:
    model = blocks.build_reference()
    for key in FROZEN:
        model.get_parameter(key).requires_grad_(False)
    return model


def _load(index: int, device: torch.device) -> torch.nn.Module:
    return (blocks.Stage0, blocks.Stage1)[index](_frozen_reference()).to(device)


def _batch(step: int, replica: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    return blocks.batch(BATCH, seed=1000 * step + replica)


def _job(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group("gloo")
    out: dict[str, Any] = {}
    for name, options in LEVELS.items():
        runner = PipelineRunner(
            blocks.manifest(),
            blocks.loss_fn,
            stage_loader=_load,
            microbatches=2,
            optimizer_factory=lambda p: torch.optim.Adam(p, lr=LR),
            timeout_s=120,
            data_parallel=options,
        )
        losses = [runner.step(*_batch(k, runner.replica)) for k in range(STEPS)]
        opt = runner.optimizer.optim if hasattr(runner.optimizer, "optim") else runner.optimizer
        names = {id(p): k for k, p in runner.stage.named_parameters()}
        model, _ = full_state_dicts(runner.stage, runner.optimizer, runner.groups.data_parallel)
        out[name] = {
            "losses": losses,
            "state": model,
            "frozen": sorted(k for k, p in runner.stage.named_parameters() if not p.requires_grad),
            "with_state": sorted(names[id(p)] for p in opt.state if id(p) in names),
            "with_grad": sorted(
                k for k, p in runner.stage.named_parameters() if p.grad is not None
            ),
        }
    dist.destroy_process_group()
    return out


@pytest.mark.distributed
def test_ddp_zero_and_fsdp2_train_a_partly_frozen_stage_like_one_process() -> None:
    results = [r.value for r in spawn(_job, STAGES * REPLICAS, timeout=600)]
    want_losses, want_state = train_on_concatenated_batches(
        _frozen_reference(),
        _batch,
        STEPS,
        REPLICAS,
        2,
        blocks.loss_fn,
        lambda p: torch.optim.Adam(p, lr=LR),
    )
    initial = blocks.build_reference().state_dict()
    for name in LEVELS:
        per_replica = [torch.tensor(results[r * STAGES][name]["losses"]) for r in range(REPLICAS)]
        torch.testing.assert_close(
            torch.stack(per_replica).mean(0),
            torch.tensor(want_losses),
            rtol=1e-5,
            atol=1e-6,
            msg=name,
        )
        state = {k: v for r in results for k, v in r[name]["state"].items()}
        for key, value in state.items():
            torch.testing.assert_close(
                value, want_state[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}"
            )
        for key in FROZEN:
            torch.testing.assert_close(
                state[key], initial[key], rtol=0, atol=0, msg=f"{name} {key}"
            )
        assert sorted({k for r in results for k in r[name]["frozen"]}) == sorted(FROZEN), name
        for r in results:
            assert not set(r[name]["with_state"]) & set(FROZEN), name
            assert not set(r[name]["with_grad"]) & set(FROZEN), name
