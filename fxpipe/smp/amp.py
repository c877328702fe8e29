"""``GradScaler``: ``torch.amp.GradScaler`` that agrees across the pipeline on skipping a step.

Each stage sees only its own gradients, so a plain scaler on stage 0 could step while
stage 1 skips on an inf, and their scales would drift apart. This one all-reduces
(max) the found-inf flag over every rank (all stages of all replicas) after unscaling, so an inf or NaN on
any stage skips the optimizer step on every stage and every stage backs off its scale
identically.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fxpipe.smp.state import current, is_initialized

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """Pipeline-aware gradient scaler; the same methods as ``torch.amp.GradScaler``.

    ``device`` defaults to this rank's device (``cuda`` with GPUs, ``cpu`` otherwise).

    Example::

        scaler = fxpipe.amp.GradScaler()
        model.backward(scaler.scale(loss))        # inside @step
        scaler.step(optimizer); scaler.update()   # after it
    """

    def __init__(
        self,
        device: str | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        if device is None:
            device = (
                current().device.type
                if is_initialized()
                else ("cuda" if torch.cuda.is_available() else "cpu")
            )
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )

    def _agree(self, optimizer: Any) -> None:
        """Replace this optimizer's found-inf flags by their maximum over the pipeline."""
        if not is_initialized() or self._scale is None:
            return
        st = current()
        state = self._per_optimizer_states[id(optimizer)]
        found = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for flag in state["found_inf_per_device"].values():
            found = torch.maximum(found, flag.to(found.device))
        if (
            st.layout.world_size > 1
        ):  # every stage of every replica: an inf anywhere skips the step everywhere
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        state["found_inf_per_device"] = {found.device: found}

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale this stage's gradients, then agree with the other stages on whether any was inf/NaN."""
        super().unscale_(optimizer)
        if self._enabled:
            self._agree(optimizer)
