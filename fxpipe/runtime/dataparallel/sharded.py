"""``ShardedStage``: one pipeline stage sharded with FSDP2 over its data-parallel group.

Note [sharding in a pipeline]: ``shard="grad-op"`` and ``"full"`` apply
``torch.distributed.fsdp.fully_shard`` to the stage's units (``units.py``) and to the
stage itself, on a ``DeviceMesh`` made from the stage's data-parallel group: every
replica keeps 1/R of each parameter, gradient and optimizer-state tensor (DTensors).
A pipeline stage runs forward and backward once per microbatch, M times per step and in
the schedule's order (1F1B runs ``F3`` before ``B1``), so FSDP's per-backward behaviour
is steered with its public switches, as ``torch.distributed.pipelining`` does for its
stages:

* every backward but the step's last runs with ``set_requires_gradient_sync(False)``:
  the gradients accumulate unsharded, and no reduce-scatter is issued; before the
  step's last backward (counted by a hook on the stage's outputs, ``_arm``) the flags
  flip to ``set_requires_gradient_sync(True)`` and ``set_is_last_backward(True)``, so
  FSDP's own post-backward hooks reduce-scatter each unit's summed gradient once, as
  soon as that unit's last backward is done (overlapping the rest of the backward);
  ``shard_reduce="microbatch"`` instead reduces after every backward (the gradients
  never exist whole for longer than one unit's backward; M reduce-scatters per step);
* ``grad-op`` (``reshard_after_forward=False``, ``set_reshard_after_backward(False)``
  until the last backward): the parameters are gathered by the step's first forward and
  stay whole until the step's last backward: one all-gather per unit per step, plus one
  where FSDP's implicit backward prefetch (which follows the *latest* forward) gathers a
  unit again when forwards and backwards alternate. (Resharding in ``sync_gradients``
  instead, to save that all-gather, trained off the one-process trajectory from the
  second step: tests/runtime/dataparallel/test_sharded_training.py.);
* ``full`` (``reshard_after_forward=True``, the root unit included, and resharding
  after every backward): a unit is whole only during its own forward or backward, and
  is gathered again for each: 2M all-gathers per unit per step, the price of ZeRO-3's
  memory (plus the one stale prefetch above on stages whose forwards and backwards
  alternate, e.g. the last stage under 1F1B: one all-gather of one unit per step).

Gradients are averaged over the replicas (FSDP divides by R) and over the microbatches
(the executor scales the loss), so the trajectory is DDP's. Replicas start from replica
0's weights and buffers (broadcast before sharding, as DDP's constructor does), and
with ``broadcast_buffers`` the buffers are broadcast again after each synchronisation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from fxpipe.errors import ConfigError, RuntimeSetupError
from fxpipe.runtime.dataparallel.options import DataParallelOptions
from fxpipe.runtime.dataparallel.replica import AccumulationWindow
from fxpipe.runtime.dataparallel.units import block_units, min_params_units

__all__ = ["ShardedStage", "shard_stage", "mixed_precision", "broadcast_state"]


def mixed_precision(options: DataParallelOptions, root: bool) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``shard_param_dtype`` / ``shard_reduce_dtype``; the root unit returns
    float32 outputs when the parameters are cast, so the loss is computed in full precision."""
    param = getattr(torch, options.shard_param_dtype) if options.shard_param_dtype else None
    reduce = getattr(torch, options.shard_reduce_dtype) if options.shard_reduce_dtype else None
    output = torch.float32 if root and param is not None else None
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce, output_dtype=output)


def broadcast_state(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Give every rank of ``group`` the parameters and buffers of its first rank (collective);
    parameters already sharded (a unit wrapped before its parent) were synced when they were."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if not isinstance(t, DTensor):
                dist.broadcast(t.data, group=group, group_src=0)


def shard_stage(stage: nn.Module, mesh: DeviceMesh, options: DataParallelOptions) -> list[nn.Module]:
    """``fully_shard`` the units of ``stage`` chosen by ``options.shard_wrap`` and the stage
    itself (the root unit) over ``mesh``; returns the units, root last."""
    if options.shard_wrap == "block":
        units = block_units(stage)
    elif options.shard_wrap == "params":
        assert options.shard_min_params is not None, "checked by DataParallelOptions"
        units = min_params_units(stage, options.shard_min_params)
    else:
        units = []
    reshard = options.shard == "full"
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=mixed_precision(options, False))
    fully_shard(stage, mesh=mesh, reshard_after_forward=reshard, mp_policy=mixed_precision(options, True))
    return [*units, stage]


class ShardedStage(AccumulationWindow):
    """Keeps ``stage``'s replicas in ``group`` in step with FSDP2 (Note [sharding in a pipeline]).

    ``backwards_per_step`` is the number of backward passes the stage runs per step (the
    microbatches). The interface is ``DataParallelStage``'s: ``passes``,
    ``should_sync``, ``end_pass``; DDP's communication hooks and ``join`` have no FSDP
    counterpart and are refused. Collective over ``group`` (the broadcast and sharding).
    """

    def __init__(self, stage: nn.Module, group: dist.ProcessGroup | None, options: DataParallelOptions,
                 device: torch.device, backwards_per_step: int) -> None:
        if not options.fsdp:
            raise ConfigError(f"ShardedStage is for shard='grad-op' or 'full', got shard={options.shard!r}")
        if backwards_per_step < 1:
            raise RuntimeSetupError(f"backwards_per_step must be >= 1, got {backwards_per_step}")
        self.stage = stage
        self.group = group
        self.options = options
        self.passes = 0            # forward_backward passes since the last synchronisation
        self.backwards = 0         # backward passes through the stage since then
        self.window = backwards_per_step * options.backward_passes_per_step
        self.hook_state: Any = None
        broadcast_state(stage, group)
        self.units: list[nn.Module] = []
        self.fsdp: FSDPModule | None = None
        if not any(p.requires_grad for p in stage.parameters()):
            return  # nothing to shard or reduce (DataParallelStage has no DDP either)
        world = group if group is not None else dist.group.WORLD
        assert world is not None, "the default process group is initialised"
        mesh = DeviceMesh.from_group(world, device.type)
        self.units = shard_stage(stage, mesh, options)
        assert isinstance(stage, FSDPModule), "fully_shard changes the stage's class in place"
        self.fsdp = stage
        stage.register_forward_hook(self._arm)
        self._accumulate()

    @property
    def size(self) -> int:
        """Replicas in the data-parallel group."""
        return dist.get_world_size(self.group)

    # -- the microbatches of a step ----------------------------------------------

    def _accumulate(self) -> None:
        """FSDP's switches for every backward of a window but the last."""
        assert self.fsdp is not None
        self.fsdp.set_requires_gradient_sync(self.options.shard_reduce == "microbatch")
        self.fsdp.set_reshard_after_backward(self.options.shard == "full")
        self.fsdp.set_is_last_backward(False)

    def _last(self) -> None:
        """FSDP's switches for the window's last backward: reduce-scatter and reshard."""
        assert self.fsdp is not None
        self.fsdp.set_requires_gradient_sync(True)
        self.fsdp.set_reshard_after_backward(True)
        self.fsdp.set_is_last_backward(True)

    def _arm(self, module: nn.Module, inputs: Any, output: Any) -> None:
        """Forward hook: count the backward that will flow into this microbatch's outputs."""
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._on_backward, mode="any")

    def _on_backward(self, grad: torch.Tensor) -> None:
        self.backwards += 1
        if self.backwards == self.window:
            self._last()

    # -- the end of an accumulation window (``end_pass``: AccumulationWindow) ------------

    def sync_gradients(self) -> None:
        """End the accumulation window: check that FSDP reduced and resharded (both already ran
        inside the window's last backward), start the next window."""
        if self.fsdp is None:
            return
        done, self.backwards = self.backwards, 0
        self._accumulate()
        if done != self.window:
            raise RuntimeSetupError(
                f"the sharded stage ran {done} backward passes in this accumulation window but expected "
                f"{self.window} (microbatches x backward_passes_per_step), so its gradients were "
                f"{'reduced early' if done > self.window else 'never reduced'}; run every microbatch's backward "
                "through the stage once per step")
        if self.options.broadcast_buffers:
            with torch.no_grad():
                for b in self.stage.buffers():
                    dist.broadcast(b, group=self.group, group_src=0)

    # -- what DDP has and FSDP does not ------------------------------------------------

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        raise ConfigError(f"shard={self.options.shard!r} reduces gradients with FSDP's reduce-scatter, which takes "
                          "no DDP communication hook; use shard 'none' or 'optimizer' to register one")

    def hook_state_dict(self) -> dict[str, Any] | None:
        """``None``: FSDP has no communication-hook state."""
        return None

    def load_hook_state_dict(self, data: dict[str, Any] | None) -> None:
        if data is not None:
            raise ConfigError("the checkpoint holds a DDP communication hook's state, but this stage is sharded "
                              f"with FSDP (shard={self.options.shard!r}), which has none; load it with the shard "
                              "level it was saved with")

    @contextlib.contextmanager
    def join(self, *joinables: Any, enable: bool = True) -> Iterator[None]:
        if enable:
            raise ConfigError(f"join() for uneven inputs is DDP's; FSDP (shard={self.options.shard!r}) has no "
                              "join: give every replica the same number of steps, or use shard 'none'/'optimizer'")
        yield
