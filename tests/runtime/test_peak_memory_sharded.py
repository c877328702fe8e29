"""The runtime's tensor-memory tracker under FSDP2: a DTensor counts its shard once, and storages FSDP frees
by resizing them (outside any op) stop counting (issue 35, item 8c: ``--shard full`` read 1.24x the
unsharded peak, of which a whole parameter set was the tracker counting each shard twice)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fxpipe.runtime.pipeline.peak_memory import TensorMemoryTracker


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_dtensor_counts_its_local_shard_once(one_rank: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    d = distribute_tensor(torch.randn(64, 64), mesh, [Shard(0)])
    with TensorMemoryTracker([d]) as tracker:
        tracker.track(d.to_local())  # the same bytes, through the local tensor
    assert tracker.peak_bytes == 64 * 64 * 4


def test_a_storage_resized_outside_ops_stops_counting(one_rank: None) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    for layer in model:
        fully_shard(layer, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    state = list(model.parameters())
    x = torch.randn(4, 64)
    param_bytes = sum(p.numel() * 4 for p in state)
    with TensorMemoryTracker(state + [x]) as tracker:
        model(x).sum().backward()
        after = tracker.live_bytes
    # the gathered parameters are freed after each layer's forward and backward (storage.resize_(0)):
    # what stays is the parameters and their gradients, and the output's few bytes
    assert after <= 2 * param_bytes + x.numel() * 4 + 4096, (after, param_bytes)
    assert tracker.peak_bytes < 4 * param_bytes + 16 * 1024
