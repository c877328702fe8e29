"""Hybrid data parallelism: R replicas of the pipeline, each stage wrapped in DDP over its data-parallel group.

``DataParallelOptions`` (the seed's DDP options, ``comm_hook``, ``shard_optimizer_state``),
``DataParallelStage`` (DDP around one stage, one all-reduce per step, comm hooks,
``join``), ``make_comm_hook`` and the hook-state checkpoint helpers, and
``shard_optimizer`` (``ZeroRedundancyOptimizer``). ``PipelineRunner(...,
data_parallel=DataParallelOptions(...))`` uses them when the world holds more than one
pipeline. See docs/dataparallel.md.
"""

from fxpipe.runtime.dataparallel.hooks import hook_state_dict, load_hook_state_dict, make_comm_hook
from fxpipe.runtime.dataparallel.options import COMM_HOOKS, DataParallelOptions
from fxpipe.runtime.dataparallel.replica import DataParallelStage
from fxpipe.runtime.dataparallel.zero import optimizer_state_bytes, shard_optimizer

__all__ = [
    "COMM_HOOKS",
    "DataParallelOptions",
    "DataParallelStage",
    "hook_state_dict",
    "load_hook_state_dict",
    "make_comm_hook",
    "optimizer_state_bytes",
    "shard_optimizer",
]
