"""Hybrid data parallelism: R replicas of the pipeline, each stage kept in sync over its data-parallel group.

``DataParallelOptions`` (the seed's DDP options, ``comm_hook``, the sharding level
``shard``), ``DataParallelStage`` (DDP around one stage, one all-reduce per step, comm
hooks, ``join``), ``ShardedStage`` (FSDP2 around one stage: ``shard='grad-op'`` or
``'full'``), ``data_parallel_stage`` / ``stage_optimizer`` (which of them a stage gets,
and its optimizer), ``make_comm_hook`` and the hook-state checkpoint helpers,
``shard_optimizer`` (``ZeroRedundancyOptimizer``), the wrap policies (``block_units``,
``min_params_units``), the checkpoints of sharded stages (``checkpoint``) and
``CollectiveCounter`` (the bytes a rank hands to collectives). ``PipelineRunner(...,
data_parallel=DataParallelOptions(...))`` uses them when the world holds more than one
pipeline. See docs/dataparallel.md.

Names load on first use, so that the options (which the CLI's parser reads) import no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fxpipe._lazy import lazy_exports, type_checking_exports

if TYPE_CHECKING:
    from fxpipe.runtime.dataparallel.hooks import (
        hook_state_dict,
        load_hook_state_dict,
        make_comm_hook,
    )
    from fxpipe.runtime.dataparallel.options import COMM_HOOKS, SHARD_LEVELS, DataParallelOptions
    from fxpipe.runtime.dataparallel.replica import DataParallelStage
    from fxpipe.runtime.dataparallel.sharded import ShardedStage
    from fxpipe.runtime.dataparallel.stage import (
        ReplicatedStage,
        data_parallel_stage,
        stage_optimizer,
    )
    from fxpipe.runtime.dataparallel.traffic import CollectiveCounter
    from fxpipe.runtime.dataparallel.fsdp_units import block_units, min_params_units
    from fxpipe.runtime.dataparallel.zero import optimizer_state_bytes, shard_optimizer

# the names above, imported on first use (Note [one list of lazy names] in fxpipe._lazy)
_LAZY = type_checking_exports(__file__)
__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
