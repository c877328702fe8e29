"""Hybrid data parallelism: R replicas of the pipeline, each stage wrapped in DDP over its data-parallel group.

``DataParallelOptions`` (the seed's DDP options, ``comm_hook``, ``shard_optimizer_state``),
``DataParallelStage`` (DDP around one stage, one all-reduce per step, comm hooks,
``join``), ``make_comm_hook`` and the hook-state checkpoint helpers, and
``shard_optimizer`` (``ZeroRedundancyOptimizer``). ``PipelineRunner(...,
data_parallel=DataParallelOptions(...))`` uses them when the world holds more than one
pipeline. See docs/dataparallel.md.

Names load on first use, so that the options (which the CLI's parser reads) import no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fxpipe._lazy import lazy_exports

if TYPE_CHECKING:
    from fxpipe.runtime.dataparallel.hooks import hook_state_dict, load_hook_state_dict, make_comm_hook
    from fxpipe.runtime.dataparallel.options import COMM_HOOKS, DataParallelOptions
    from fxpipe.runtime.dataparallel.replica import DataParallelStage
    from fxpipe.runtime.dataparallel.zero import optimizer_state_bytes, shard_optimizer

_LAZY = {
    "hook_state_dict": "hooks",
    "load_hook_state_dict": "hooks",
    "make_comm_hook": "hooks",
    "COMM_HOOKS": "options",
    "DataParallelOptions": "options",
    "DataParallelStage": "replica",
    "optimizer_state_bytes": "zero",
    "shard_optimizer": "zero",
}

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


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
