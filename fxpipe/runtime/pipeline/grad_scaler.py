"""``ShardedGradScaler``: FairScale's shard-aware loss scaler, as torch's own.

torch's ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` (a
``torch.amp.GradScaler``) all-reduces the found-inf flag over the process group, so a
step is skipped on every rank when any rank's shard of the gradients overflowed. FairScale's
constructor has no ``device``: it is CUDA when available, else the CPU (``device=`` names
another, as the pipeline's fp16 scaler does: ``fxpipe.runtime.pipeline.precision``). With FSDP2's
DTensor gradients torch's unscaling warns, once per step, that it treats the one-element
found-inf flag as replicated (which is what it is); that warning is silenced here.

Note [scaler import time]: torch's ``ShardedGradScaler.__init__`` has the default
``process_group=dist.group.WORLD``, read when its module is imported. Imported after
``init_process_group``, the function's defaults keep the default group alive for the rest of
the process, whatever a caller passes: ``destroy_process_group`` then leaves its gloo threads
running into the interpreter's exit, where a rank could abort (``terminate called without an
active exception``). So the modules that use it import it at their top, which the runtime
imports before it creates any group; ``tests/runtime/test_training_fp16.py`` checks that no
gloo thread outlives the group.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as _TorchShardedGradScaler
from torch.distributed.tensor import DTensor

from fxpipe.runtime.local_shard import local_tensor

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(_TorchShardedGradScaler):
    """FairScale's ``ShardedGradScaler(init_scale=2**16, growth_factor=2.0, backoff_factor=0.5,
    growth_interval=2000, enabled=True, process_group=WORLD)``; ``device``: where the scale lives.
    ``process_group=None`` is the default group, looked up at each all-reduce (Note [scaler
    import time])."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: str | None = None,
    ) -> None:
        super().__init__(
            device or ("cuda" if torch.cuda.is_available() else "cpu"),
            init_scale=init_scale,
            backoff_factor=backoff_factor,
            growth_factor=growth_factor,
            growth_interval=growth_interval,
            enabled=enabled,
            process_group=process_group,
        )

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool = True,
    ) -> Any:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if any(isinstance(x, DTensor) for x in grads) and not all(
            isinstance(x, DTensor) for x in grads
        ):  # Note [found-inf of tensor-parallel gradients]
            optimizer = _LocalGrads(optimizer)  # type: ignore[assignment]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)


class _LocalGrads:
    """An optimizer's param groups as seen by the unscaling: each gradient as the tensor this rank
    holds (a DTensor's local shard, sharing its storage).

    Note [found-inf of tensor-parallel gradients]: with tensor parallelism a stage's gradients
    mix DTensors (split linears) and plain tensors (replicated parameters); torch's unscaling
    runs one ``_amp_foreach_non_finite_check_and_unscale_`` per device and dtype, whose DTensor
    rule expects DTensors only (``AttributeError: 'Tensor' object has no attribute
    'placements'``). Each rank checks and unscales the local tensors instead, and the found-inf
    flag is then all-reduced over the scaler's group (every rank of the job for the pipeline's
    fp16 scaler), so an inf in one tp rank's shard skips the step everywhere.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.param_groups = [
            {"params": [_Local(p) for p in g["params"] if p.grad is not None]}
            for g in optimizer.param_groups
        ]


class _Local:
    def __init__(self, param: torch.Tensor) -> None:
        grad = param.grad
        self.grad = None if grad is None else local_tensor(grad)
