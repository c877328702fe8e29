"""``DataParallelStage``: one pipeline stage wrapped in DDP over its data-parallel group.

Note [one all-reduce per step]: a pipeline stage runs forward and backward once per
microbatch, and the schedule interleaves them (1F1B runs ``F3`` before ``B1``), but
DDP's reducer pairs every synchronised forward with the next backward. So the
microbatches run on the bare stage, which is DDP's ``no_sync`` behaviour: gradients
accumulate locally in ``.grad``. When the step's last backward is done,
``sync_gradients`` makes one *synchronising pass* through the DDP wrapper, a forward
whose output is ``sum(p.sum() * 0)`` over the stage's parameters: its backward adds
zero to every gradient, so every parameter's autograd hook fires once, DDP reduces
all its buckets with the registered communication hook, and writes the averaged
gradients back into ``.grad``. That is exactly DDP's own path (buckets, comm hooks,
``broadcast_buffers`` in the pass's forward, ``join()`` shadowing), run once per step
instead of once per microbatch, and it needs no ``find_unused_parameters``: the pass
touches every parameter. With ``backward_passes_per_step = k`` the pass runs only on
every k-th call. A stage without trainable parameters has no DDP and nothing to sync.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from fxpipe.errors import ConfigError
from fxpipe.runtime.dataparallel.hooks import (
    CommHook,
    hook_state_dict,
    load_hook_state_dict,
    make_comm_hook,
)
from fxpipe.runtime.dataparallel.options import DataParallelOptions

__all__ = ["DataParallelStage", "AccumulationWindow"]


class _SyncPass(nn.Module):
    """Holds the stage; its forward is the synchronising pass of Note [one all-reduce per step]."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self) -> torch.Tensor:
        params = [p for p in self.stage.parameters() if p.requires_grad]
        return torch.stack([p.sum() * 0 for p in params]).sum()


class AccumulationWindow:
    """``backward_passes_per_step`` bookkeeping shared by the DDP and the FSDP stage: the replicas
    synchronise (``sync_gradients``) at the end of every k-th pass."""

    options: DataParallelOptions
    passes: int  # forward_backward passes since the last synchronisation

    def should_sync(self) -> bool:
        """Whether the pass that is about to end completes an accumulation window."""
        return (self.passes + 1) % self.options.backward_passes_per_step == 0

    def end_pass(self) -> bool:
        """Call after each step's backwards: synchronise if the window is complete; whether it did."""
        sync = self.should_sync()
        self.passes = 0 if sync else self.passes + 1
        if sync:
            self.sync_gradients()
        return sync

    @property
    def weight_params(self) -> dict[int, list[torch.Tensor]]:
        """The parameters a split backward's ``W`` differentiates, by stage, where they are not the
        stage's own (``ShardedStage``: FSDP's whole parameters); DDP leaves them as they are."""
        return {}

    def complete_grads(self) -> None:
        """At the end of a window, before the tied gradients are summed across ranks: make this
        rank's gradients whole (nothing for DDP; ``ShardedStage`` reduces its split chunks)."""

    def sync_gradients(self) -> None:
        raise NotImplementedError


class DataParallelStage(AccumulationWindow):
    """Keeps ``stage``'s replicas in ``group`` identical: same start, averaged gradients.

    Building it broadcasts the stage's parameters and buffers from the group's first
    rank (DDP's constructor), so every replica starts from replica 0's weights, and
    settles DDP's bucket layout (``_settle_buckets``). Collective over ``group``.
    """

    def __init__(
        self,
        stage: nn.Module,
        group: dist.ProcessGroup | None,
        options: DataParallelOptions,
        device: torch.device,
    ) -> None:
        self.stage = stage
        self.group = group
        self.options = options
        self.passes = 0  # forward_backward passes since the last synchronisation
        self.ddp: DistributedDataParallel | None = None
        self.hook_state: Any = None
        self._custom_hook = False
        if not any(p.requires_grad for p in stage.parameters()):
            return
        device_ids = [device] if device.type == "cuda" else None
        self.ddp = DistributedDataParallel(
            _SyncPass(stage), device_ids=device_ids, process_group=group, **options.ddp_kwargs()
        )
        self._settle_buckets()
        if options.comm_hook != "allreduce":
            self.hook_state, hook = make_comm_hook(
                options.comm_hook, group, options.powersgd_rank, options.powersgd_start_iter
            )
            self.ddp.register_comm_hook(self.hook_state, hook)

    @property
    def size(self) -> int:
        """Replicas in the data-parallel group."""
        return dist.get_world_size(self.group)

    # -- gradients -------------------------------------------------------------

    def sync_gradients(self) -> None:
        """Average the accumulated gradients over the replicas through DDP (collective in the group)."""
        if self.ddp is None:
            return
        with torch.enable_grad():
            self.ddp().backward()

    def _settle_buckets(self) -> None:
        """One synchronising pass on zero gradients, before any hook is registered.

        DDP rebuilds its buckets in gradient-ready order after its first backward. A
        stateful hook keys its state by bucket index (PowerSGD's error feedback), so the
        layout must be the same in a fresh job that resumes from a checkpoint as in the
        job that saved it: settling it here means every hook only ever sees the rebuilt
        layout. The parameters' ``.grad`` are restored afterwards.
        """
        assert self.ddp is not None
        saved = [(p, p.grad) for p in self.stage.parameters()]
        self.sync_gradients()
        for p, grad in saved:
            p.grad = grad

    # -- hooks -----------------------------------------------------------------

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """``DistributedDataParallel.register_comm_hook`` on this stage (at most once, before training)."""
        if self.ddp is None:
            return
        if self.hook_state is not None or self._custom_hook:
            raise ConfigError(
                f"a communication hook ({self.options.comm_hook!r} or a custom one) is already "
                "registered on this stage and DDP accepts only one; pass comm_hook='allreduce' "
                "when you register your own"
            )
        self.ddp.register_comm_hook(state, hook)
        self.hook_state, self._custom_hook = state, True

    def hook_state_dict(self) -> dict[str, Any] | None:
        """The hook's state (PowerSGD error feedback, iteration, rng) for a checkpoint; ``None`` if stateless."""
        return hook_state_dict(self.hook_state)

    def load_hook_state_dict(self, data: dict[str, Any] | None) -> None:
        """Restore what ``hook_state_dict`` returned, so training resumes with the same hook state."""
        if self.ddp is not None:
            load_hook_state_dict(self.hook_state, data, self.group)

    # -- uneven inputs ---------------------------------------------------------

    @contextlib.contextmanager
    def join(self, *joinables: Any, enable: bool = True) -> Iterator[None]:
        """DDP's ``join`` for replicas that run different numbers of steps (with ``joinables``, e.g. ZeRO).

        A replica that leaves the loop early shadows the others' all-reduces until they
        finish; afterwards all replicas hold the last one's parameters.
        """
        if self.ddp is None:
            yield
            return
        from torch.distributed.algorithms.join import Join

        with Join([self.ddp, *joinables], enable=enable):
            yield
