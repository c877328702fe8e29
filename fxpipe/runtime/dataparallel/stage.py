"""What keeps a stage's replicas in sync, by sharding level, and the optimizer that goes with it.

``data_parallel_stage`` wraps a stage for its data-parallel group: ``DataParallelStage``
(DDP, Note [one all-reduce per step]) for ``shard`` ``none`` and ``optimizer``,
``ShardedStage`` (FSDP2, Note [sharding in a pipeline]) for ``grad-op`` and ``full``.
``stage_optimizer`` then builds the optimizer over the stage's parameters as they are
after wrapping (FSDP's DTensor shards), or a ``ZeroRedundancyOptimizer`` of the same
class and options for ``optimizer``. ``PipelineRunner`` and the seed API both use them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from fxpipe.runtime.dataparallel.options import DataParallelOptions
from fxpipe.runtime.dataparallel.replica import DataParallelStage
from fxpipe.runtime.dataparallel.sharded import ShardedStage
from fxpipe.runtime.dataparallel.zero import shard_optimizer

__all__ = ["data_parallel_stage", "stage_optimizer", "ReplicatedStage"]

ReplicatedStage = DataParallelStage | ShardedStage


def data_parallel_stage(
    stage: nn.Module,
    group: dist.ProcessGroup | None,
    options: DataParallelOptions,
    device: torch.device,
    backwards_per_step: int,
    chunks: Mapping[int, nn.Module] | None = None,
    split_stages: Collection[int] = (),
    mesh: DeviceMesh | None = None,
) -> ReplicatedStage:
    """Wrap ``stage`` for its data-parallel ``group`` as ``options.shard`` says (collective over ``group``).

    ``backwards_per_step``: backward passes through each stage per step (its microbatches).
    ``chunks``: the pipeline stages ``stage`` holds, by index, when the rank runs several;
    ``split_stages``: those whose backward the schedule splits into ``B`` and ``W``. FSDP
    shards each chunk on its own (Note [sharding in a pipeline]); DDP needs neither.
    ``mesh``: FSDP's mesh over ``group`` when the stage is tensor-parallel (the ``dp`` dim of its
    ``(dp, tp)`` mesh, Note [FSDP over TP]).
    """
    if options.fsdp:
        return ShardedStage(
            stage, group, options, device, backwards_per_step, chunks, split_stages, mesh
        )
    return DataParallelStage(stage, group, options, device)


def stage_optimizer(
    stage: nn.Module,
    factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    data_parallel: ReplicatedStage | None,
) -> torch.optim.Optimizer | None:
    """``factory`` over ``stage``'s trainable parameters (as wrapping left them), sharded over the
    data-parallel group for ``shard='optimizer'``; ``None`` for a stage without trainable parameters."""
    params = [p for p in stage.parameters() if p.requires_grad]
    if not params:
        return None
    if isinstance(data_parallel, DataParallelStage) and data_parallel.options.shard == "optimizer":
        return shard_optimizer(params, factory, data_parallel.group)
    return factory(params)
