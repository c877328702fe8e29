"""The seed-compatible training API: ``import fxpipe as smp`` for scripts written against it.

``init(config)``, the rank functions, ``DistributedModel``, ``@step``,
``DistributedOptimizer``, ``partition(i)``, ``save``/``load`` and ``amp.GradScaler``,
running on fxpipe's compiler (partitioning at the first step) and runtime (torch.distributed
point-to-point, runtime schedules), with DDP over the data-parallel replicas when ``ddp: True``.
See docs/seed-api.md and docs/dataparallel.md.
"""

from fxpipe.smp.amp import GradScaler
from fxpipe.smp.partitioning import apply_partition_policy
from fxpipe.smp.checkpoint import CheckpointError, load, save
from fxpipe.smp.config import Config
from fxpipe.smp.driver import StepError
from fxpipe.smp.model import DDPOptions, DistributedModel
from fxpipe.smp.state import PARTIAL_KEY
from fxpipe.smp.optimizer import DistributedOptimizer
from fxpipe.smp.state import (
    barrier,
    broadcast,
    dp_rank,
    dp_size,
    get_dp_process_group,
    get_mp_process_group,
    get_tp_process_group,
    get_world_process_group,
    init,
    is_initialized,
    is_tracing,
    local_rank,
    local_size,
    mp_rank,
    mp_size,
    rank,
    shutdown,
    size,
    tp_rank,
    tp_size,
)
from fxpipe.smp.step import StepOutput, step
from fxpipe.tracer.construct.pins import partition

__all__ = [
    "PARTIAL_KEY",
    "CheckpointError",
    "Config",
    "DDPOptions",
    "DistributedModel",
    "DistributedOptimizer",
    "GradScaler",
    "StepError",
    "StepOutput",
    "apply_partition_policy",
    "barrier",
    "broadcast",
    "dp_rank",
    "dp_size",
    "get_dp_process_group",
    "get_mp_process_group",
    "get_tp_process_group",
    "get_world_process_group",
    "init",
    "is_initialized",
    "is_tracing",
    "load",
    "local_rank",
    "local_size",
    "mp_rank",
    "mp_size",
    "partition",
    "rank",
    "save",
    "shutdown",
    "size",
    "step",
    "tp_rank",
    "tp_size",
]
