"""When FSDP gathers a sharded stage's units (``plan_unshards``, Note [gathers in a pipeline]).

On CPU no unit prefetches in backward and every all-gather is freed at its copy-out; where
collectives overlap compute, each unit's backward prefetches the unit whose backward comes
next, never a unit of another microbatch's forward. Either way training is FSDP's without a
plan (one rank, so the gathers are local and the test is fast).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from fxpipe.runtime.dataparallel import DataParallelOptions
from fxpipe.runtime.dataparallel.sharded import plan_unshards, shard_stage


@pytest.fixture
def mesh() -> Iterator[object]:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _stage() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))


def _targets(unit: nn.Module) -> list[nn.Module]:
    assert isinstance(unit, FSDPModule)
    state = unit._get_fsdp_state()
    return [s._modules[0] for s in state._states_to_backward_prefetch]


def _async(unit: nn.Module) -> list[bool]:
    assert isinstance(unit, FSDPModule)
    return [g.unshard_async_op for g in unit._get_fsdp_state()._fsdp_param_groups]


@pytest.mark.parametrize("overlap", [False, True])
def test_each_unit_prefetches_only_the_unit_whose_backward_is_next(mesh, overlap: bool) -> None:
    stage = _stage()
    units = shard_stage(stage, mesh, DataParallelOptions(shard="full"))  # 3 Linears, then the root
    plan_unshards(units, overlap=overlap)
    for i, unit in enumerate(units):
        # naming itself prefetches nothing (it is whole when its backward starts)
        assert _targets(unit) == [units[i - 1] if overlap and i > 0 else unit]
        assert all(a is not overlap for a in _async(unit))  # CPU: freed at copy-out


@pytest.mark.parametrize("overlap", [False, True])
def test_a_planned_stage_trains_as_fsdp_does_without_a_plan(mesh, overlap: bool) -> None:
    x = torch.randn(4, 8)
    grads = []
    for plan in (False, True):
        stage = _stage()
        units = shard_stage(stage, mesh, DataParallelOptions(shard="full"))
        if plan:
            plan_unshards(units, overlap=overlap)
        for _ in range(3):  # microbatches accumulated
            stage(x).pow(2).sum().backward()
        grads.append([p.grad.full_tensor() for p in stage.parameters()])
    for planned, plain in zip(grads[1], grads[0]):
        torch.testing.assert_close(planned, plain, rtol=0, atol=0)
