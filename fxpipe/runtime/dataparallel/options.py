"""``DataParallelOptions``: how each stage's data-parallel replicas are kept in sync.

The fields are the seed API's DDP options (``overlapping_allreduce``,
``backward_passes_per_step``, ``bucket_cap_mb``, ``broadcast_buffers``,
``gradient_as_bucket_view``) plus fxpipe's ``comm_hook`` shorthand and
``shard_optimizer_state`` (``torch.distributed.optim.ZeroRedundancyOptimizer``).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import asdict, dataclass, fields
from typing import Any

from fxpipe.errors import ConfigError

__all__ = ["DataParallelOptions", "COMM_HOOKS"]


@functools.cache
def _buffers_key() -> str:
    """DDP's name for ``broadcast_buffers``: torch >= 2.13 renamed it ``forward_sync_buffers``.
    Looked up on first use, so that the options (and the CLI that builds them) import no torch."""
    from torch.nn.parallel import DistributedDataParallel

    return ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
            else "broadcast_buffers")

# The ``comm_hook`` shorthands, each a hook of torch.distributed.algorithms.ddp_comm_hooks.
COMM_HOOKS = ("allreduce", "fp16", "bf16", "powersgd", "batched_powersgd")


@dataclass(frozen=True)
class DataParallelOptions:
    """Options of the ``DistributedDataParallel`` wrapper around every stage.

    ``overlapping_allreduce``: all-reduce each gradient bucket as soon as it is ready
    (``False``: one bucket, reduced when all gradients are ready). ``backward_passes_per_step``:
    accumulate this many ``forward_backward`` passes locally before one all-reduce.
    ``bucket_cap_mb``, ``broadcast_buffers``, ``gradient_as_bucket_view`` go to DDP as
    they are. ``comm_hook`` names a built-in DDP communication hook; ``powersgd_rank``
    and ``powersgd_start_iter`` configure PowerSGD. ``shard_optimizer_state`` shards the
    optimizer state over the data-parallel group (ZeRO stage 1).

    >>> DataParallelOptions(comm_hook="powersgd", powersgd_rank=2).comm_hook
    'powersgd'
    """

    overlapping_allreduce: bool = True
    backward_passes_per_step: int = 1
    bucket_cap_mb: float = 25.0
    broadcast_buffers: bool = True
    gradient_as_bucket_view: bool = False
    comm_hook: str = "allreduce"
    powersgd_rank: int = 1
    powersgd_start_iter: int = 2
    shard_optimizer_state: bool = False

    def __post_init__(self) -> None:
        for key in ("overlapping_allreduce", "broadcast_buffers", "gradient_as_bucket_view", "shard_optimizer_state"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"data-parallel option {key!r} must be True or False, got {getattr(self, key)!r}")
        steps = self.backward_passes_per_step
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ConfigError(f"backward_passes_per_step must be an int >= 1, got {steps!r}; "
                              "use 1 to all-reduce after every step")
        if not isinstance(self.bucket_cap_mb, (int, float)) or self.bucket_cap_mb <= 0:
            raise ConfigError(f"bucket_cap_mb must be a positive number of megabytes, got {self.bucket_cap_mb!r}; "
                              "DDP's default is 25")
        if self.comm_hook not in COMM_HOOKS:
            raise ConfigError(f"unknown comm_hook {self.comm_hook!r}; expected one of {list(COMM_HOOKS)} "
                              "(or register your own with register_comm_hook(state, hook))")
        if not isinstance(self.powersgd_rank, int) or self.powersgd_rank < 1:
            raise ConfigError(f"powersgd_rank must be an int >= 1, got {self.powersgd_rank!r}; 1, 2 or 4 are usual")
        if not isinstance(self.powersgd_start_iter, int) or self.powersgd_start_iter < 2:
            raise ConfigError(f"powersgd_start_iter must be an int >= 2 (PowerSGD needs plain all-reduce steps "
                              f"while DDP rebuilds its buckets), got {self.powersgd_start_iter!r}")

    def check_replicas(self, replicas: int) -> None:
        """Refuse options that would silently do nothing: with one replica there is no DDP,
        so no hook, no sharding and no accumulation across all-reduces."""
        if replicas > 1:
            return
        changed = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}
        if changed:
            shown = ", ".join(f"{k}={v!r}" for k, v in changed.items())
            raise ConfigError(f"data-parallel options {shown} only apply with 2 or more pipeline replicas "
                              f"(--dp R, or a world of stages x R ranks), but this job has one; drop them or add replicas")

    def cost_fields(self, replicas: int) -> dict[str, Any]:
        """The ``CostModel`` fields that price this data parallelism (``CostModel(**fields)``):
        replicas, hook, PowerSGD rank and the DDP bucket size the reducer really uses."""
        bucket_mb = self.ddp_kwargs()["bucket_cap_mb"]
        return {"dp_replicas": replicas, "comm_hook": self.comm_hook, "powersgd_rank": self.powersgd_rank,
                "dp_bucket_bytes": int(bucket_mb * 2**20)}

    def ddp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``torch.nn.parallel.DistributedDataParallel``."""
        return {
            # without overlap all gradients go into one bucket, reduced once every gradient is ready
            "bucket_cap_mb": self.bucket_cap_mb if self.overlapping_allreduce else 1e6,
            _buffers_key(): self.broadcast_buffers,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DataParallelOptions:
        """Inverse of ``to_dict``; missing keys take their defaults, unknown keys are refused."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(f"unknown data-parallel options {unknown}; expected some of {known}")
        return cls(**data)
