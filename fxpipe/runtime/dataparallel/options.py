"""``DataParallelOptions``: how each stage's data-parallel replicas are kept in sync.

The fields are the seed API's DDP options (``overlapping_allreduce``,
``backward_passes_per_step``, ``bucket_cap_mb``, ``broadcast_buffers``,
``gradient_as_bucket_view``) plus fxpipe's ``comm_hook`` shorthand and the sharding
level ``shard`` (``none``, ``optimizer``: ``ZeroRedundancyOptimizer``; ``grad-op`` and
``full``: FSDP2's ``fully_shard``) with the ``shard_*`` options of the sharded levels.
``shard_optimizer_state=True`` is kept as the older spelling of ``shard="optimizer"``.

The fields are the one declaration of these options (Note [options declared once] in
``fxpipe.optionspec``): ``fxpipe run``'s flags, the workers' JSON and the keys of
``fxpipe.init``'s config (``seed_keys``) come from them, and the fields that the planner
prices are ``CostModel``'s, taken over with ``same_as``.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from fxpipe.errors import ConfigError
from fxpipe.optionspec import Options, Switch, check_options, option, same_as
from fxpipe.partitioner.cost import COMM_HOOKS, SHARD_DTYPES, SHARD_LEVELS, SHARD_REDUCE, CostModel

__all__ = [
    "DataParallelOptions",
    "COMM_HOOKS",
    "SHARD_LEVELS",
    "SHARD_REDUCE",
    "SHARD_WRAP",
    "SHARD_DTYPES",
    "FSDP_LEVELS",
]


@functools.cache
def _buffers_key() -> str:
    """DDP's name for ``broadcast_buffers``: torch >= 2.13 renamed it ``forward_sync_buffers``.
    Looked up on first use, so that the options (and the CLI that builds them) import no torch."""
    from torch.nn.parallel import DistributedDataParallel

    return (
        "forward_sync_buffers"
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        else "broadcast_buffers"
    )


# The ``comm_hook`` shorthands (each a hook of torch.distributed.algorithms.ddp_comm_hooks), the sharding
# levels over a stage's data-parallel group (ZeRO 0-3), the mode of the sharded levels' gradient reduction and
# their mixed-precision dtypes are the cost model's (COMM_HOOKS, SHARD_LEVELS, SHARD_REDUCE, SHARD_DTYPES);
# the sharded levels' wrap policies are the runtime's own.
SHARD_WRAP = ("block", "params", "stage")
FSDP_LEVELS = ("grad-op", "full")
_DDP_ONLY = (
    "overlapping_allreduce",
    "bucket_cap_mb",
    "gradient_as_bucket_view",
    "comm_hook",
    "powersgd_rank",
    "powersgd_start_iter",
)


@dataclass(frozen=True)
class DataParallelOptions(Options):
    """Options of the ``DistributedDataParallel`` wrapper around every stage.

    ``overlapping_allreduce``: all-reduce each gradient bucket as soon as it is ready
    (``False``: one bucket, reduced when all gradients are ready). ``backward_passes_per_step``:
    accumulate this many ``forward_backward`` passes locally before one all-reduce.
    ``bucket_cap_mb``, ``broadcast_buffers``, ``gradient_as_bucket_view`` go to DDP as
    they are. ``comm_hook`` names a built-in DDP communication hook; ``powersgd_rank``
    and ``powersgd_start_iter`` configure PowerSGD.

    ``shard`` shards training state over the data-parallel group: ``"optimizer"`` the
    optimizer state (ZeRO-1, ``ZeroRedundancyOptimizer`` behind DDP); ``"grad-op"``
    gradients and optimizer state, the parameters gathered once per step (ZeRO-2,
    ``fully_shard(reshard_after_forward=False)``); ``"full"`` parameters too, gathered
    for every microbatch's forward and backward (ZeRO-3). The sharded levels (Note
    [sharding in a pipeline] in ``fxpipe.runtime.dataparallel.sharded``) reduce-scatter
    the gradients once per step after the stage's last backward (``shard_reduce="step"``)
    or after every microbatch's backward (``"microbatch"``: the gradients stay sharded,
    M times the reduce-scatter traffic); ``shard_wrap`` picks the FSDP units (``"block"``:
    each block of the stage's module stacks, ``"params"``: FairScale's ``auto_wrap`` by
    ``shard_min_params``, ``"stage"``: one unit); ``shard_param_dtype`` /
    ``shard_reduce_dtype`` are FSDP2's ``MixedPrecisionPolicy``. ``shard_optimizer_state``
    is the older spelling of ``shard="optimizer"`` and always equals it.

    >>> DataParallelOptions(comm_hook="powersgd", powersgd_rank=2).comm_hook
    'powersgd'
    >>> DataParallelOptions(shard_optimizer_state=True).shard
    'optimizer'
    """

    what: ClassVar[str] = "data-parallel options"

    overlapping_allreduce: bool = option(
        True, flag=False, help="all-reduce each gradient bucket once it is ready"
    )
    backward_passes_per_step: int = option(
        1,
        metavar="K",
        help="accumulate K steps' gradients locally before one all-reduce and optimizer step",
    )
    bucket_cap_mb: float = option(25.0, flag=False, help="DDP's gradient bucket size in MiB")
    broadcast_buffers: bool = option(
        True, flag=False, help="DDP broadcasts rank 0's buffers before each forward"
    )
    gradient_as_bucket_view: bool = option(
        False, flag=False, help="gradients are views into DDP's buckets"
    )
    comm_hook: str = same_as(CostModel, "comm_hook", seed_key="comm_hook")
    powersgd_rank: int = same_as(CostModel, "powersgd_rank", seed_key="powersgd_rank")
    powersgd_start_iter: int = option(
        2, flag=False, help="plain all-reduce steps before PowerSGD compresses"
    )
    shard_optimizer_state: bool = option(
        False,
        flag=False,
        seed_key="shard_optimizer_state",
        help="the older spelling of shard='optimizer'",
    )
    shard: str = same_as(
        CostModel,
        "shard",
        seed_key="shard",
        default_text="the plan's with 2+ replicas, else none",
        switches=(
            Switch(
                "--shard-optimizer-state", "optimizer", "the older spelling of --shard optimizer"
            ),
        ),
    )
    shard_reduce: str = same_as(CostModel, "shard_reduce", seed_key="shard_reduce")
    shard_wrap: str = option(
        "block",
        choices=SHARD_WRAP,
        metavar="POLICY",
        seed_key="shard_wrap",
        help="with --shard grad-op/full: FSDP units: each block of the stage's module stacks, "
        "by --shard-min-params, or the whole stage",
    )
    shard_min_params: int | None = option(
        None,
        metavar="N",
        none_means="none",
        seed_key="shard_min_params",
        help="with --shard-wrap params: parameters per FSDP unit (FairScale's auto_wrap)",
    )
    shard_param_dtype: str | None = same_as(
        CostModel, "shard_param_dtype", seed_key="shard_param_dtype"
    )
    shard_reduce_dtype: str | None = same_as(
        CostModel, "shard_reduce_dtype", seed_key="shard_reduce_dtype"
    )

    def __post_init__(self) -> None:
        for key in (
            "overlapping_allreduce",
            "broadcast_buffers",
            "gradient_as_bucket_view",
            "shard_optimizer_state",
        ):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(
                    f"data-parallel option {key!r} must be True or False, got {getattr(self, key)!r}"
                )
        steps = self.backward_passes_per_step
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ConfigError(
                f"backward_passes_per_step must be an int >= 1, got {steps!r}; "
                "use 1 to all-reduce after every step"
            )
        if not isinstance(self.bucket_cap_mb, (int, float)) or self.bucket_cap_mb <= 0:
            raise ConfigError(
                f"bucket_cap_mb must be a positive number of megabytes, got {self.bucket_cap_mb!r}; "
                "DDP's default is 25"
            )
        check_options(
            self
        )  # the checks declared with comm_hook, powersgd_rank, shard, ... (CostModel's)
        if not isinstance(self.powersgd_start_iter, int) or self.powersgd_start_iter < 2:
            raise ConfigError(
                f"powersgd_start_iter must be an int >= 2 (PowerSGD needs plain all-reduce steps "
                f"while DDP rebuilds its buckets), got {self.powersgd_start_iter!r}"
            )
        self._check_shard()

    def _check_shard(self) -> None:
        """Validate how the sharding fields go together (each one's own check is declared with it,
        ``check_options``), resolve the ``shard_optimizer_state`` alias, and refuse
        options that the chosen level would ignore."""
        if self.shard_optimizer_state:
            if self.shard not in ("none", "optimizer"):
                raise ConfigError(
                    f"shard_optimizer_state=True (= shard 'optimizer') contradicts shard={self.shard!r}; "
                    f"drop shard_optimizer_state: shard={self.shard!r} shards the optimizer state too"
                )
            object.__setattr__(self, "shard", "optimizer")
        object.__setattr__(self, "shard_optimizer_state", self.shard == "optimizer")
        if self.shard_wrap not in SHARD_WRAP:
            raise ConfigError(
                f"unknown shard_wrap {self.shard_wrap!r}; expected one of {list(SHARD_WRAP)}"
            )
        size = self.shard_min_params
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ConfigError(
                f"shard_min_params must be an int >= 1 (parameters per FSDP unit), got {size!r}"
            )
        if (self.shard_wrap == "params") != (size is not None):
            raise ConfigError(
                "shard_wrap='params' and shard_min_params go together: give both (FairScale's "
                f"auto_wrap(min_num_params=N)), got shard_wrap={self.shard_wrap!r}, "
                f"shard_min_params={size!r}"
            )
        if self.shard in FSDP_LEVELS:
            ddp = [
                f"{k}={getattr(self, k)!r}" for k in _DDP_ONLY if getattr(self, k) != _DEFAULTS[k]
            ]
            if ddp:
                raise ConfigError(
                    f"shard={self.shard!r} reduces gradients with FSDP's reduce-scatter, which has no "
                    f"counterpart of the DDP options {', '.join(ddp)}; drop them (FSDP2's "
                    "MixedPrecisionPolicy is shard_reduce_dtype, e.g. 'bfloat16')"
                )
            return
        fsdp = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if f.name.startswith("shard_")
            and f.name != "shard_optimizer_state"
            and getattr(self, f.name) != f.default
        ]
        if fsdp:
            raise ConfigError(
                f"{', '.join(fsdp)} only apply to shard='grad-op' or 'full' (FSDP), but shard is "
                f"{self.shard!r}; drop them or pick a sharded level"
            )

    @property
    def fsdp(self) -> bool:
        """Whether the stage is sharded with FSDP2 (levels ``grad-op`` and ``full``) rather than DDP."""
        return self.shard in FSDP_LEVELS

    def check_replicas(self, replicas: int) -> None:
        """Refuse options that would silently do nothing: with one replica there is no DDP,
        so no hook, no sharding and no accumulation across all-reduces."""
        if replicas > 1:
            return
        changed = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) != f.default and f.name != "shard_optimizer_state"
        }  # shown as shard
        if changed:
            shown = ", ".join(f"{k}={v!r}" for k, v in changed.items())
            raise ConfigError(
                f"data-parallel options {shown} only apply with 2 or more pipeline replicas "
                f"(--dp R, or a world of stages x R ranks), but this job has one; drop them or add replicas"
            )

    def cost_fields(self, replicas: int) -> dict[str, Any]:
        """The ``CostModel`` fields that price this data parallelism (``CostModel(**fields)``):
        replicas, hook, PowerSGD rank and the DDP bucket size the reducer really uses."""
        bucket_mb = self.ddp_kwargs()["bucket_cap_mb"]
        return {
            "dp_replicas": replicas,
            "dp_bucket_bytes": int(bucket_mb * 2**20),
            **{name: getattr(self, name) for name in _PRICED},
        }

    def ddp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``torch.nn.parallel.DistributedDataParallel``."""
        return {
            # without overlap all gradients go into one bucket, reduced once every gradient is ready
            "bucket_cap_mb": self.bucket_cap_mb if self.overlapping_allreduce else 1e6,
            _buffers_key(): self.broadcast_buffers,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
        }


_DEFAULTS = {f.name: f.default for f in fields(DataParallelOptions)}
# the options the cost model prices: the fields it shares with these (comm_hook, powersgd_rank, shard, ...)
_PRICED = tuple(
    f.name for f in fields(DataParallelOptions) if f.name in {g.name for g in fields(CostModel)}
)
