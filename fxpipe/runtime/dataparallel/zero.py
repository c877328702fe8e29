"""Optimizer-state sharding over a stage's data-parallel group (ZeRO stage 1).

``shard_optimizer`` turns the optimizer a user's factory builds into
``torch.distributed.optim.ZeroRedundancyOptimizer`` of the same class and options:
each replica keeps the state (momentum, Adam moments) of only its share of the
stage's parameters, steps that share, and broadcasts the updated parameters to the
other replicas. Gradients are still averaged by DDP first, so the trajectory is the
unsharded one.
"""

from __future__ import annotations

import inspect

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from fxpipe.errors import ConfigError

__all__ = ["shard_optimizer", "optimizer_state_bytes"]


def shard_optimizer(
    params: list[nn.Parameter],
    factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    group: dist.ProcessGroup | None,
) -> ZeroRedundancyOptimizer:
    """``ZeroRedundancyOptimizer`` over ``group`` with the class and defaults of ``factory(params)``."""
    template = factory(params)
    if len(template.param_groups) != 1:
        raise ConfigError(
            f"shard_optimizer_state needs an optimizer with one parameter group, but the factory made "
            f"{len(template.param_groups)}; add the other groups later with add_param_group, or turn "
            "sharding off"
        )
    # only what the class's constructor takes: AdamW's groups hold decoupled_weight_decay, which
    # torch.optim.AdamW does not accept (Adam's subclass fixes it)
    takes = inspect.signature(type(template).__init__).parameters
    defaults = {k: v for k, v in template.param_groups[0].items() if k != "params" and k in takes}
    return ZeroRedundancyOptimizer(
        params, optimizer_class=type(template), process_group=group, **defaults
    )


def _tensor_bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, dict):
        return sum(_tensor_bytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(v) for v in x)
    return 0


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensors in the optimizer state this rank holds (its shard under ZeRO)."""
    opt = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    return sum(_tensor_bytes(s) for s in opt.state.values())
