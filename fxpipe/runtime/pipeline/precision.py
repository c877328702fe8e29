"""Mixed precision per stage: each stage's forward (and the loss) runs under ``torch.autocast``.

``--precision bf16`` wraps the forward of every stage module of the rank, and the loss
function, in ``torch.autocast(device_type, dtype=torch.bfloat16)``, as one process would
wrap the whole model's forward and loss; the backward runs outside autocast, as torch
recommends (it replays the dtypes the forward chose). Parameters, gradients and
optimizer state stay in fp32. An fp32 tensor crossing a stage boundary is sent in the
autocast dtype (``wire_dtype``; half the bytes, and the plan prices it so with
``fxpipe partition --precision``), as Megatron-LM sends its activations in the pipeline
dtype: the receiving stage would cast it under autocast anyway, except where an op
autocast keeps in fp32 (a norm, a residual sum) reads it, which then sees the rounding of
one cast more than one process does (within the precision's tolerance). Its gradient comes
back in the same dtype.

bf16 needs no loss scaling. ``--precision fp16`` does: ``PipelineScaler`` is one dynamic
loss scale for the whole job. Every rank holds the same scale (a power of two); the last
stage multiplies each microbatch loss by it, so every stage's gradients arrive scaled;
after the backward each rank unscales its own stage's gradients and the found-inf flags
are summed by one all-reduce over the world (every stage of every replica), so an inf or
NaN anywhere skips the optimizer step on every rank and every rank backs off (or grows)
its scale identically. It is torch's ``ShardedGradScaler`` (``fxpipe.runtime.pipeline.grad_scaler``),
which already all-reduces found-inf over a process group and unscales FSDP's DTensor
gradients, given the whole world as its group.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fxpipe.errors import ConfigError
from fxpipe.runtime.pipeline.grad_scaler import ShardedGradScaler  # Note [scaler import time]
from fxpipe.runtime.train.training_options import PRECISIONS

__all__ = ["autocast_dtype", "autocast_stages", "autocast_loss", "wire_dtype", "PipelineScaler"]

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of ``precision`` (``None``: full precision)."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    return _DTYPES[precision]


def wire_dtype(dtype: torch.dtype, autocast: torch.dtype | None) -> torch.dtype:
    """The dtype a boundary tensor of ``dtype`` travels in between stages: fp32 ones in the autocast
    dtype (half the bytes; the receiving stage computes in it anyway), others as they are. The
    plan prices them so (``CostModel.precision``)."""
    return autocast if autocast is not None and dtype == torch.float32 else dtype


def _wrap(fn: Callable[..., Any], device_type: str, dtype: torch.dtype) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return fn(*args, **kwargs)

    return run


def autocast_stages(modules: Iterable[nn.Module], device: torch.device, dtype: torch.dtype) -> None:
    """Run each module's forward under autocast (the instance's ``forward``; its state dict is unchanged)."""
    for module in modules:
        module.forward = _wrap(module.forward, device.type, dtype)


def autocast_loss(
    loss_fn: Callable[[Any, Any], torch.Tensor], device: torch.device, dtype: torch.dtype
) -> Callable[[Any, Any], torch.Tensor]:
    """``loss_fn`` computed under autocast (cross-entropy and reductions in fp32, as autocast chooses)."""
    return _wrap(loss_fn, device.type, dtype)


class PipelineScaler:
    """fp16's dynamic loss scale, shared by every rank of the job (collective: all ranks call
    ``unscale_``, ``step`` and ``update`` once per optimizer step, in that order).

    ``optimizer`` is this rank's (``None`` for a stage without trainable parameters: such a
    rank still joins the found-inf all-reduce, through a zero-gradient placeholder).
    ``scaler`` is the ``torch.amp.GradScaler`` doing the work; its ``state_dict`` is what a
    checkpoint keeps.
    """

    def __init__(
        self,
        device: torch.device,
        optimizer: torch.optim.Optimizer | None,
        *,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
    ) -> None:
        self.scaler = ShardedGradScaler(
            init_scale=init_scale,
            growth_interval=growth_interval,
            device=device.type,
        )
        self.scaler.scale(
            torch.zeros((), device=device)
        )  # every rank makes its scale now, not only the loss rank
        if optimizer is None:
            self._placeholder = torch.zeros(1, device=device, requires_grad=True)
            optimizer = torch.optim.SGD([self._placeholder], lr=0.0)
        self.optimizer = optimizer
        self._unscaled = False
        self.skipped = False

    @property
    def scale(self) -> float:
        """The current loss scale (a power of two, the same on every rank)."""
        return float(self.scaler.get_scale())

    def scaled(
        self, loss_fn: Callable[[Any, Any], torch.Tensor]
    ) -> Callable[[Any, Any], torch.Tensor]:
        """``loss_fn`` times the scale: what the last stage backpropagates."""

        @functools.wraps(loss_fn)
        def run(outputs: Any, targets: Any) -> torch.Tensor:
            return self.scaler.scale(loss_fn(outputs, targets))

        return run

    def unscale_(self) -> None:
        """Divide this rank's gradients by the scale and agree with every rank on found-inf (once per step)."""
        if self._unscaled:
            return
        if hasattr(self, "_placeholder"):
            self._placeholder.grad = torch.zeros_like(self._placeholder)
        self.scaler.unscale_(self.optimizer)
        self._unscaled = True

    def step(self) -> bool:
        """Step the optimizer unless some rank found an inf/NaN; update the scale. True if it stepped."""
        self.unscale_()
        before = self.scale
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self._unscaled = False
        self.skipped = self.scale < before  # a found inf always backs the scale off (backoff 0.5)
        return not self.skipped
