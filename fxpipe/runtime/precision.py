"""Mixed precision per stage: each stage's forward (and the loss) runs under ``torch.autocast``.

``--precision bf16`` wraps the forward of every stage module of the rank, and the loss
function, in ``torch.autocast(device_type, dtype=torch.bfloat16)``, as one process would
wrap the whole model's forward and loss; the backward runs outside autocast, as torch
recommends (it replays the dtypes the forward chose). Parameters, gradients and
optimizer state stay in fp32; tensors crossing a stage boundary are sent in the
manifest's dtype (Note [implied communication] in ``fxpipe.runtime.stage_io``). bf16
needs no loss scaling; fp16 (which does) is not offered yet.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

from fxpipe.errors import ConfigError
from fxpipe.runtime.training_options import PRECISIONS

__all__ = ["autocast_dtype", "autocast_stages", "autocast_loss"]


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of ``precision`` (``None``: full precision)."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    return torch.bfloat16 if precision == "bf16" else None


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


def autocast_loss(loss_fn: Callable[[Any, Any], torch.Tensor], device: torch.device,
                  dtype: torch.dtype) -> Callable[[Any, Any], torch.Tensor]:
    """``loss_fn`` computed under autocast (cross-entropy and reductions in fp32, as autocast chooses)."""
    return _wrap(loss_fn, device.type, dtype)
