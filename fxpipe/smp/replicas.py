"""``Replicas``: the data parallelism of one ``DistributedModel`` (its stage in DDP over the data-parallel group).

With ``ddp: True`` and ``world = partitions x R`` processes, every stage is wrapped
in ``fxpipe.runtime.dataparallel.DataParallelStage`` over its data-parallel group
(the same stage in every replica; with several stages per process, the process's
``RankChunks`` as one module) as soon as the first step has partitioned the
model. Calls made before that (``register_comm_hook``, loading a hook state,
entering ``join``) are kept and applied right after partitioning, so the seed's
scripts, which set everything up before the first step, work unchanged.

At the end of each step (Note [one all-reduce per step] in
``fxpipe.runtime.dataparallel.replica``) the tied copies are summed once per
accumulation window and then ``DataParallelStage.end_pass`` averages the gradients
over the replicas on every ``backward_passes_per_step``-th step.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fxpipe.errors import ConfigError
from fxpipe.runtime.dataparallel import (
    DataParallelOptions,
    ReplicatedStage,
    ShardedStage,
    data_parallel_stage,
)
from fxpipe.runtime.dataparallel.hooks import CommHook
from fxpipe.runtime.pipeline.tensor_parallel import tensor_parallel_replicas

__all__ = ["Replicas"]


class Replicas:
    """One model's data-parallel state: options, the DDP-wrapped stage, and what waits for partitioning."""

    def __init__(self, options: DataParallelOptions, replicas: int, microbatches: int = 1) -> None:
        self.options = options
        self.replicas = replicas
        self.microbatches = microbatches  # backward passes through the stage per step
        self.stage: ReplicatedStage | None = None
        self._hook: tuple[Any, CommHook] | None = None
        self._hook_state: dict[str, Any] | None = None
        self._join: contextlib.ExitStack | None = None
        self._join_enable = True

    # -- lifecycle (called by DistributedModel) ----------------------------------

    def attach(
        self,
        module: nn.Module,
        group: dist.ProcessGroup | None,
        device: torch.device,
        tensor_parallel: bool = False,
    ) -> None:
        """Wrap the freshly partitioned stage in DDP or FSDP (collective over ``group``) and apply pending calls."""
        if self.replicas == 1:
            return
        if tensor_parallel:  # Note [TP under DDP] in fxpipe.runtime.pipeline.tensor_parallel
            self.stage = tensor_parallel_replicas(module, group, self.options, device)
        else:
            self.stage = data_parallel_stage(module, group, self.options, device, self.microbatches)
        if self._hook is not None:
            self.stage.register_comm_hook(*self._hook)
        if self._hook_state is not None:
            self.stage.load_hook_state_dict(self._hook_state)
        self._hook = self._hook_state = None

    def warm_up(self, run: Callable[[], None]) -> None:
        """Run a compiled stage's warm-up through the wrapped stage's FSDP (collective; Note
        [compiling under FSDP] in ``fxpipe.runtime.pipeline.compiled``)."""
        with (
            self.stage.warming_up()
            if isinstance(self.stage, ShardedStage)
            else contextlib.nullcontext()
        ):
            run()

    def start_join(self, joinables: Sequence[Any]) -> None:
        """Enter DDP's ``join`` now if ``join()`` was entered before partitioning (with the sharded optimizers)."""
        if self._join is not None and self.stage is not None:
            self._join.enter_context(self.stage.join(*joinables, enable=self._join_enable))

    def end_step(self, sum_tied_grads: Callable[[], None]) -> None:
        """After a step's backwards: sum tied copies once per accumulation window, then sync the replicas."""
        if self.stage is None:
            sum_tied_grads()
            return
        if self.stage.should_sync():
            sum_tied_grads()
        self.stage.end_pass()

    @property
    def synced(self) -> bool:
        """Whether the gradients are averaged over the replicas (no accumulation window is open)."""
        return self.stage is None or self.stage.passes == 0

    # -- the user's calls ------------------------------------------------------

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Register a DDP communication hook on the stage, now or right after partitioning."""
        if self.replicas == 1:
            warnings.warn(
                "register_comm_hook: this job has one data-parallel replica, so there is no DDP and the "
                "hook never runs; launch a multiple of 'partitions' processes with 'ddp': True",
                stacklevel=3,
            )
            return
        if self.options.comm_hook != "allreduce":
            raise ConfigError(
                f"config 'comm_hook' is {self.options.comm_hook!r} and DDP accepts one hook per model; "
                "set 'comm_hook': 'allreduce' (the default) to register your own"
            )
        if self.stage is not None:
            self.stage.register_comm_hook(state, hook)
        elif self._hook is not None:
            raise ConfigError(
                "register_comm_hook was already called; DDP accepts one communication hook per model"
            )
        else:
            self._hook = (state, hook)

    def hook_state_dict(self) -> dict[str, Any] | None:
        """The communication hook's state (PowerSGD error feedback, iteration, rng); ``None`` if stateless."""
        if self.stage is None:
            return self._hook_state
        return self.stage.hook_state_dict()

    def load_hook_state_dict(self, data: dict[str, Any] | None) -> None:
        """Restore a ``hook_state_dict``, now or right after partitioning."""
        if self.stage is None:
            self._hook_state = data
        else:
            self.stage.load_hook_state_dict(data)

    @contextlib.contextmanager
    def join(self, joinables: Callable[[], Sequence[Any]], enable: bool = True) -> Iterator[None]:
        """DDP's ``join`` for uneven inputs; entered now, or right after partitioning if that is still to come."""
        if self._join is not None:
            raise ConfigError(
                "model.join() is already active; enter it once, around the whole training loop"
            )
        self._join, self._join_enable = contextlib.ExitStack(), enable
        try:
            with self._join:
                if self.stage is not None:
                    self.start_join(joinables())
                yield
        finally:
            self._join = None
