"""Process-wide state of the seed-compatible API: ``init`` and the common functions.

The seed library is a set of module-level functions (``smp.rank()``, ``smp.mp_rank()``
...) over one global state, so this module keeps exactly one ``_State``. ``init``
reads torchrun's environment, initialises the default process group with the
runtime's code (``fxpipe.runtime.pipeline.groups``), and fixes the rank layout
(``fxpipe.runtime.pipeline.layout.RankLayout``: ``mp_rank`` is the stage, ``dp_rank`` the
replica, ``tp_rank`` the tensor-parallel index; ranks are replica-major, tp innermost,
``rank = (dp_rank * partitions + mp_rank) * tensor_parallel_degree + tp_rank``). Each tp index
of a replica is a pipeline of its own (``mp_group``), as in ``fxpipe run --tp``
(docs/tensor-parallel.md).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from fxpipe.errors import ConfigError, RuntimeSetupError
from fxpipe.runtime.pipeline.groups import init_process_group, pick_device, this_rank
from fxpipe.runtime.pipeline.layout import RankLayout
from fxpipe.smp.config import Config
from fxpipe.smp.config_agreement import check_same_config
from fxpipe.tracer.construct.pins import module_pins
from fxpipe.tracer.construct.record import BuildRecord, record_constructors

__all__ = [
    "init",
    "is_initialized",
    "is_tracing",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "mp_rank",
    "mp_size",
    "dp_rank",
    "dp_size",
    "tp_rank",
    "tp_size",
    "barrier",
    "broadcast",
    "get_world_process_group",
    "get_mp_process_group",
    "get_dp_process_group",
    "get_tp_process_group",
    "current",
    "shutdown",
    "APIState",
    "OptimizerRegistry",
    "WrappedOptimizer",
    "PARTIAL_KEY",
]

DEFAULT_TIMEOUT_S = 300.0
PARTIAL_KEY = "_smp_is_partial"  # the seed's marker of a partial (one-partition) state dict


class WrappedOptimizer(Protocol):
    """What the registry and the model need of ``fxpipe.smp.optimizer.WrappedOptimizer`` (declared here,
    below it, so the state module needs nothing of the optimizer's)."""

    optimizer: Any
    zero: Any  # the ZeroRedundancyOptimizer holding the state shard, if any

    def localize(self, model: Any) -> None: ...

    def uninstall(self) -> None: ...


class OptimizerRegistry:
    """The optimizers given to ``DistributedOptimizer``, each with its fxpipe bookkeeping
    (Note [optimizer in place] in ``fxpipe.smp.optimizer``), by identity, in the order wrapped."""

    def __init__(self) -> None:
        self._wrapped: dict[int, WrappedOptimizer] = {}

    def add(self, wrapped: WrappedOptimizer) -> None:
        self._wrapped[id(wrapped.optimizer)] = wrapped

    def get(self, optimizer: Any) -> WrappedOptimizer | None:
        """The bookkeeping of ``optimizer``, or ``None`` if it was not wrapped."""
        wrapped = self._wrapped.get(id(optimizer))
        return wrapped if wrapped is not None and wrapped.optimizer is optimizer else None

    def __iter__(self) -> Iterator[WrappedOptimizer]:
        return iter(list(self._wrapped.values()))

    def clear(self) -> None:
        """Forget every optimizer, taking fxpipe's methods off each."""
        for wrapped in self:
            wrapped.uninstall()
        self._wrapped.clear()


@dataclass
class APIState:
    """What ``init`` set up. Mutable on purpose: the one process-wide registry."""

    config: Config
    layout: RankLayout
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mp_group: Any
    dp_group: Any
    owns_group: bool
    timeout_s: float = DEFAULT_TIMEOUT_S
    replica_group: Any = None  # every rank of this replica (pp x tp), None: the world
    tp_mesh: Any = (
        None  # this rank's tp dim of the (dp, pp, tp) mesh, with tensor_parallel_degree > 1
    )
    tp_context: contextlib.ExitStack = field(
        default_factory=contextlib.ExitStack
    )  # implicit replication while a tensor-parallel model lives (Note [DTensor regions])
    tracing: bool = False
    model: Any = None  # the one DistributedModel
    optimizers: OptimizerRegistry = field(
        default_factory=OptimizerRegistry
    )  # localized after partitioning
    constructed: Any = field(
        default_factory=weakref.WeakKeyDictionary
    )  # module -> (args, kwargs) since init
    recorder: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    step_calls: int = 0  # @step calls, and whether their batch differed from the first stage's:
    warned_batch: bool = False  # Note [one batch per pipeline] in fxpipe.smp.step_batch

    def build_record(self, model: nn.Module) -> BuildRecord:
        """Constructor arguments of ``model``'s submodules built after ``init``, and its ``partition`` pins.

        The tracer keeps modules it cannot look into as leaves, and a stage file has to
        construct such a leaf again, with the arguments its ``__init__`` got. Recording
        stops here: the model is built, and ``nn.Module`` is left as it was.
        """
        self.recorder.close()
        ctor_args = {
            path: self.constructed[m]
            for path, m in model.named_modules(remove_duplicate=False)
            if m in self.constructed
        }
        return BuildRecord(ctor_args=ctor_args, pins=module_pins(model))

    @property
    def mp_rank(self) -> int:
        return self.layout.stage_of(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.layout.replica_of(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_of(self.rank)

    @property
    def pipeline_group(self) -> Any:
        """This rank's pipeline group for collectives: ``None`` (the world) when the job is one pipeline."""
        one = self.layout.replicas == 1 and self.layout.tensor_parallel == 1
        return None if one else self.mp_group

    def pipeline_rank_of(self, stage: int) -> int:
        """The global rank of pipeline rank ``stage`` in this rank's pipeline (same replica, tp index)."""
        return self.layout.rank_of(stage, self.dp_rank, self.tp_rank)


_STATE: APIState | None = None
_GROUP_KEPT = False  # init created the default group, then refused its config


def current() -> APIState:
    """The state set by ``init``; a clear error before it."""
    if _STATE is None:
        raise ConfigError(
            "fxpipe.init(config) has not been called: call it once at the top of the training script, "
            "e.g. fxpipe.init({'partitions': 2, 'microbatches': 4})"
        )
    return _STATE


def init(
    config: Mapping[str, Any] | Config | None = None,
    *,
    device: str | torch.device | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Validate ``config``, join the torchrun job, check that every rank has the same config, and fix the
    rank layout.

    Example::

        import fxpipe as smp
        smp.init({"partitions": 2, "microbatches": 4, "pipeline": "interleaved"})
    """
    global _STATE, _GROUP_KEPT
    cfg = config if isinstance(config, Config) else Config.from_dict(config)
    if _STATE is not None:
        if _STATE.config != cfg:
            raise ConfigError(
                f"fxpipe.init was already called with {_STATE.config}; it cannot be called again with "
                f"another config {cfg} in the same process"
            )
        return
    rank, world, local = this_rank()
    dev = pick_device(device, local)
    owns = init_process_group(dev, timeout_s) or _GROUP_KEPT
    _GROUP_KEPT = False
    try:
        check_same_config(cfg)  # before any rank acts on it (fxpipe.smp.config_agreement)
        replicas = cfg.check_world(world)
    except ConfigError:
        _GROUP_KEPT = owns  # a corrected init in this process takes the group over
        raise
    layout = RankLayout(cfg.partitions, replicas, cfg.tensor_parallel_degree)
    mp_group, dp_group, replica_group = _make_groups(layout, rank)
    tp_mesh = None
    if layout.tensor_parallel > 1:  # fxpipe.runtime.pipeline.tensor_parallel: the (dp, pp, tp) mesh
        from fxpipe.runtime.pipeline.tensor_parallel import tensor_parallel_mesh

        tp_mesh = tensor_parallel_mesh(layout, dev)
    _STATE = APIState(
        cfg,
        layout,
        rank,
        world,
        local,
        dev,
        mp_group,
        dp_group,
        owns,
        timeout_s,
        replica_group=replica_group,
        tp_mesh=tp_mesh,
    )
    _STATE.recorder.enter_context(
        record_constructors(_STATE.constructed)
    )  # until partitioning or shutdown


def _make_groups(layout: RankLayout, rank: int) -> tuple[Any, Any, Any]:
    """The pipeline (mp), data-parallel and replica groups of ``rank``, created on every rank in one
    order; with tensor parallelism each tp index has its own pipeline and data-parallel groups."""
    mp_group = dp_group = replica_group = None
    tp, tps = layout.tp_of(rank), range(layout.tensor_parallel)
    for r in range(layout.replicas):
        for t in tps:
            g = (
                dist.new_group(list(layout.pipeline_ranks(r, t)))
                if layout.replicas > 1 or layout.tensor_parallel > 1
                else dist.group.WORLD
            )
            if (r, t) == (layout.replica_of(rank), tp):
                mp_group = g
    for s in range(layout.num_stages):
        for t in tps:
            g = dist.new_group(list(layout.data_parallel_ranks(s, t)))
            if (s, t) == (layout.stage_of(rank), tp):
                dp_group = g
    if layout.replicas > 1:
        per = layout.num_stages * layout.tensor_parallel
        for r in range(layout.replicas):
            g = (
                dist.new_group(list(range(r * per, (r + 1) * per)))
                if layout.tensor_parallel > 1
                else None
            )
            if r == layout.replica_of(rank):
                replica_group = g if g is not None else mp_group
    return mp_group, dp_group, replica_group


def shutdown(destroy_process_group: bool = True) -> None:
    """Forget the state (model, optimizers, config), so ``init`` may be called again.

    Destroys the default process group if ``init`` created it, unless
    ``destroy_process_group=False`` (to run several trainings in one job).
    """
    global _STATE, _GROUP_KEPT
    if _STATE is not None:
        _STATE.recorder.close()
        _STATE.tp_context.close()
        _STATE.optimizers.clear()
    owns = _STATE.owns_group if _STATE is not None else _GROUP_KEPT
    if owns and destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()
        _GROUP_KEPT = False
    _STATE = None


def is_initialized() -> bool:
    """Whether ``init`` has been called in this process."""
    return _STATE is not None


def is_tracing() -> bool:
    """Whether this process is tracing the model right now (during the first step's partitioning)."""
    return _STATE is not None and _STATE.tracing


def rank() -> int:
    """Global rank of this process."""
    return current().rank


def size() -> int:
    """Number of processes in the job."""
    return current().world_size


def local_rank() -> int:
    """Rank of this process on its machine (torchrun's LOCAL_RANK)."""
    return current().local_rank


def local_size() -> int:
    """Processes on this machine (torchrun's LOCAL_WORLD_SIZE)."""
    current()
    return int(os.environ.get("LOCAL_WORLD_SIZE", size()))


def mp_rank() -> int:
    """The pipeline stage (partition) this process runs."""
    return current().mp_rank


def mp_size() -> int:
    """Number of pipeline stages (``partitions``)."""
    return current().layout.num_stages


def dp_rank() -> int:
    """Which data-parallel replica this process belongs to (0 .. ``dp_size() - 1``)."""
    return current().dp_rank


def dp_size() -> int:
    """Number of data-parallel replicas (world size / ``partitions``; more than 1 needs ``ddp: True``)."""
    return current().layout.replicas


def tp_rank() -> int:
    """This process's index in its stage's tensor-parallel group (0 .. ``tp_size() - 1``)."""
    return current().tp_rank


def tp_size() -> int:
    """Ranks per stage that split its linears (``tensor_parallel_degree``)."""
    return current().layout.tensor_parallel


def get_world_process_group() -> Any:
    """The group of all processes."""
    current()
    return dist.group.WORLD


def get_mp_process_group() -> Any:
    """The group of this process's pipeline (the stages of one replica, of its tp index)."""
    return current().mp_group


def get_dp_process_group() -> Any:
    """The group of the processes holding the same stage (and tp index) in every replica."""
    return current().dp_group


def get_tp_process_group() -> Any:
    """The group of the processes splitting this rank's stage (``None`` without tensor parallelism)."""
    st = current()
    return st.tp_mesh.get_group() if st.tp_mesh is not None else None


def barrier(group: Any = None) -> None:
    """Wait for every process in ``group`` (default: all)."""
    current()
    dist.barrier(group=group)


def broadcast(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Every process gets ``obj`` of global rank ``src`` (a picklable object; call on all ranks of ``group``).

    Unlike the seed library's sender-only ``broadcast``/``recv_from`` pair, this is one
    symmetric collective, like ``torch.distributed.broadcast_object_list``.
    """
    st = current()
    if not 0 <= src < st.world_size:
        raise RuntimeSetupError(
            f"broadcast source rank {src} is outside the world of {st.world_size} processes"
        )
    box = [obj if st.rank == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
