"""``ShardedStage``: a rank's pipeline stage (each of its chunks) sharded with FSDP2 over its data-parallel group.

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
  stay whole until the step's last backward: one all-gather per unit per step (Note
  [gathers in a pipeline]). (Resharding in ``sync_gradients`` instead of in the last
  backward trained off the one-process trajectory from the second step:
  tests/runtime/dataparallel/test_sharded_training.py.);
* ``full`` (``reshard_after_forward=True``, the root unit included, and resharding
  after every backward): a unit is whole only during its own forward or backward, and
  is gathered again for each: 2M all-gathers per unit per step, the price of ZeRO-3's
  memory.

Note [gathers in a pipeline]: left to itself, FSDP prefetches in backward the unit that
ran before the current one in a forward, through a stack of forward positions that
assumes backwards run in the reverse order of forwards; a pipeline schedule interleaves
microbatches (1F1B runs ``F3`` before ``B2``), so the backward of a stage's first unit can
prefetch the last unit of an earlier forward (the root), which nothing waits on, its flat
all-gather output alive until that unit's next forward. In forward it keeps each unit's flat all-gather
output until the next unit's copy-out, to overlap the two on separate CUDA streams.
``plan_unshards`` sets both per unit with FSDP's switches: each unit's backward prefetches
exactly the unit whose backward comes next (``set_modules_to_backward_prefetch``), and on
CPU, where gloo's collectives block the calling thread so that a prefetch or a deferred
free overlaps nothing and only holds memory, no unit prefetches and every all-gather is
issued with ``async_op``, whose output FSDP frees as soon as it is copied out. On CPU a unit
is then whole only while it runs, plus its flat all-gather output during its copy-out
(FSDP2 gathers into one buffer and copies each parameter out of it). Measured with
run.json's tracker on 2 stages x 2 replicas, SGD, 1F1B, 4 microbatches
(tests/runtime/dataparallel/test_sharded_training.py, benchmarks/dataparallel/README.md): a
stage of 4 equal ``Linear`` units peaks at 0.72x the unsharded run (0.84x before);
``examples/gpt.py`` (2 blocks a stage, activations half the peak) at 1.02-1.05x with one
unit per block (1.10-1.12x before the plan): at the peak, in a block's backward copy-out, that
block's whole parameters and its flat all-gather buffer (2 x 50,816 bytes, a block being 45%
of the stage's parameters) outweighed the half of the parameters sharding saves (55,936), the
gradients accumulating whole as under DDP. Such blocks are now split into the children they
call (Note [units small enough to save] in ``fsdp_units.py``): 0.94x / 0.90x on the two stages
(``--shard-reduce microbatch``, the gradients kept sharded: 0.86x / 0.79x).

A rank that runs several chunks (``--virtual-stages``: interleaved-1f1b, zbv) shards each
chunk as its own FSDP module (its own root, switches and count), as
``torch.distributed.pipelining`` shards each of its stages; a parameter tied between two
chunks of the rank gets one copy per chunk, their gradients summed after the reduction
(``chunk_ties``). Under a schedule that splits a chunk's backward (zb-h1, zbv; Note [split
backward through the saved graph]) ``B`` brings only the input gradients, and FSDP's
post-backward hooks fire before ``W`` has computed the weight gradients: there every
backward runs with ``set_requires_gradient_sync(False)`` and
``set_reshard_after_backward(False)`` (the gathered parameters stay whole for ``W``, and
``W`` differentiates FSDP's whole parameters, ``unsharded_parameters``), and after the
step's last ``W`` ``_ShardedChunk.reduce`` runs each unit's post-backward by hand, so the
summed gradients are reduce-scattered once and the parameters resharded, as
``torch.distributed.pipelining``'s ``perform_reduce_grad`` does. ``full`` then still
reshards after each forward, but holds a chunk's parameters from its first backward to
the step's end; ``shard_reduce="microbatch"`` is refused there (``PipelineRunner``).

Note [FSDP over TP]: with tensor parallelism (``--tp T``) a stage's split parameters are
DTensors on its tp group. As torchtitan composes FSDP with TP, ``parallelize_module`` runs
first (on the ``tp`` dim of the stage's ``(dp, tp)`` mesh, ``fxpipe.runtime.pipeline.
tensor_parallel.stage_mesh``), then ``fully_shard`` over its ``dp`` dim: FSDP2 (torch 2.13,
``FSDPParam._init_sharding_spec_tp``) shards the tp shard it is given over dp, its sharded
parameter a DTensor on the 2-D mesh (``Shard(0)`` on dp, or ``_StridedShard`` when tp splits
dim 0 too, then the tp placement), its all-gather restoring the tp DTensor the emitted code
and the tp hooks expect; a gradient left ``Partial`` on tp (a vocabulary-parallel embedding's)
is redistributed to the parameter's layout before the reduce-scatter. Both dims must be
slices of one root mesh (FSDP concatenates them), so the ``dp`` dim is passed in as ``mesh``
instead of a mesh made from the data-parallel group. Replicated parameters stay plain and are
sharded over dp alone. Replicas are synchronised from replica 0 as without TP, each rank
broadcasting its local tp shard over its dp group (every replica of one tp index holds the
same shard). A split backward (``W`` differentiating FSDP's whole parameters, which are tp
DTensors then) and several chunks per rank are not combined with TP (refused by the runner).

Gradients are averaged over the replicas (FSDP divides by R) and over the microbatches
(the executor scales the loss), so the trajectory is DDP's. Replicas start from replica
0's weights and buffers (broadcast before sharding, as DDP's constructor does), and
with ``broadcast_buffers`` the buffers are broadcast again after each synchronisation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from fxpipe.errors import ConfigError, RuntimeSetupError
from fxpipe.runtime.dataparallel.chunk_ties import TiedCopies, untie_chunks
from fxpipe.runtime.dataparallel.options import DataParallelOptions
from fxpipe.runtime.dataparallel.replica import AccumulationWindow
from fxpipe.runtime.dataparallel.fsdp_units import (
    stage_units,
)

__all__ = [
    "ShardedStage",
    "shard_stage",
    "mixed_precision",
    "broadcast_state",
    "unsharded_parameters",
]


def mixed_precision(options: DataParallelOptions, root: bool) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``shard_param_dtype`` / ``shard_reduce_dtype``; the root unit returns
    float32 outputs when the parameters are cast, so the loss is computed in full precision."""
    param = getattr(torch, options.shard_param_dtype) if options.shard_param_dtype else None
    reduce = getattr(torch, options.shard_reduce_dtype) if options.shard_reduce_dtype else None
    output = torch.float32 if root and param is not None else None
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce, output_dtype=output)


def broadcast_state(
    module: nn.Module, group: dist.ProcessGroup | None, local_shards: bool = False
) -> None:
    """Give every rank of ``group`` the parameters and buffers of its first rank (collective);
    parameters already sharded (a unit wrapped before its parent) were synced when they were.
    ``local_shards``: DTensors are tensor-parallel shards, equal in layout on every rank of
    ``group``: each rank's local shard is broadcast too (Note [FSDP over TP])."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if not isinstance(t, DTensor):
                dist.broadcast(t.data, group=group, group_src=0)
            elif local_shards:
                dist.broadcast(t.to_local().data, group=group, group_src=0)


def shard_stage(
    stage: nn.Module, mesh: DeviceMesh, options: DataParallelOptions
) -> list[nn.Module]:
    """``fully_shard`` the units of ``stage`` (``stage_units``) and the stage itself (the root
    unit) over ``mesh``; returns the units, root last."""
    units = stage_units(stage, options, mesh.size())
    reshard = options.shard == "full"
    for unit in units:
        fully_shard(
            unit,
            mesh=mesh,
            reshard_after_forward=reshard,
            mp_policy=mixed_precision(options, False),
        )
    fully_shard(
        stage, mesh=mesh, reshard_after_forward=reshard, mp_policy=mixed_precision(options, True)
    )
    return [*units, stage]


def unsharded_parameters(module: nn.Module) -> list[torch.Tensor]:
    """The whole parameters FSDP runs ``module``'s forward with: the ones its autograd graphs hold,
    into which a split backward's ``W`` adds the weight gradients. FSDP keeps these tensors
    from the first all-gather on and only frees and refills their storage, so they are
    gathered once here (collective over the mesh) and resharded."""
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    params: list[torch.Tensor] = [p for p in module.parameters() if p.requires_grad]
    for unit in units:
        unit.reshard()
    assert not any(isinstance(p, DTensor) for p in params), (
        "unshard() registers the whole parameters"
    )
    return params


def plan_unshards(units: list[nn.Module], overlap: bool) -> None:
    """Set when FSDP gathers each unit of one chunk (``units`` as ``shard_stage`` returns them:
    module order, which is forward order for stacks, the root last; Note [gathers in a
    pipeline]): with ``overlap`` (collectives that overlap compute) each unit's backward
    prefetches the unit before it (whose backward comes next), the first unit's nothing;
    without, no unit prefetches and every all-gather is freed as soon as it is copied out."""
    fsdp = [u for u in units if isinstance(u, FSDPModule)]
    for i, unit in enumerate(fsdp):
        # the root (last) runs its backward first, then the units from the last to the first;
        # naming only itself is FSDP's public way to prefetch nothing (an empty list restores
        # the implicit prefetch; unsharding a unit that is already whole is a no-op)
        unit.set_modules_to_backward_prefetch([fsdp[i - 1] if overlap and i > 0 else unit])
        if not overlap:
            unit._set_unshard_async_op(True)


class _ShardedChunk:
    """One chunk (the rank's stage, or one of its ``--virtual-stages`` chunks) as its own FSDP
    module: its switches and the count of backwards of the accumulation window."""

    def __init__(
        self, module: nn.Module, options: DataParallelOptions, window: int, split: bool
    ) -> None:
        assert isinstance(module, FSDPModule), "fully_shard changes the chunk's class in place"
        self.fsdp: FSDPModule = module
        self.options = options
        self.window = window
        self.split = split  # some backward is split into B and W: reduce after the window's last W
        self.backwards = 0  # backward passes through the chunk since the last synchronisation
        self.weight_params = unsharded_parameters(module) if split else []
        if not split:
            module.register_forward_hook(self._arm)
        self.accumulate()

    def accumulate(self) -> None:
        """FSDP's switches for every backward of a window but the last (every backward, when split:
        the parameters stay whole for ``W`` and the gradients unreduced until ``reduce``)."""
        split = self.split
        self.fsdp.set_requires_gradient_sync(
            self.options.shard_reduce == "microbatch" and not split
        )
        self.fsdp.set_reshard_after_backward(self.options.shard == "full" and not split)
        self.fsdp.set_is_last_backward(False)

    def _last(self) -> None:
        """FSDP's switches for the window's last backward: reduce-scatter and reshard."""
        self.fsdp.set_requires_gradient_sync(True)
        self.fsdp.set_reshard_after_backward(True)
        self.fsdp.set_is_last_backward(True)

    def _arm(self, module: nn.Module, inputs: Any, output: Any) -> None:
        """Forward hook: count the backward that will flow into this microbatch's outputs."""
        if not torch.is_grad_enabled():
            return
        tensors = [
            t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._on_backward, mode="any")

    def _on_backward(self, grad: torch.Tensor) -> None:
        self.backwards += 1
        if self.backwards == self.window:
            self._last()

    def reduce(self) -> None:
        """After a split window's last ``W``: run FSDP's post-backward of every unit by hand (the
        weight gradients came after the units' own post-backward hooks), so the accumulated
        gradients are reduce-scattered once and the parameters resharded; then the root's
        end-of-backward callback, which waits for the reductions (as ``torch.distributed.pipelining``
        does for its zero-bubble stages)."""
        self._last()
        state = fully_shard.state(self.fsdp)  # type: ignore[attr-defined]
        for unit in state._state_ctx.all_states:
            for group in unit._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()

    def finish(self) -> int:
        """Start the next window; the backwards this one counted (split: not counted, the window's size)."""
        done, self.backwards = self.backwards, 0
        self.accumulate()
        return self.window if self.split else done


class ShardedStage(AccumulationWindow):
    """Keeps ``stage``'s replicas in ``group`` in step with FSDP2 (Note [sharding in a pipeline]).

    ``backwards_per_step`` is the number of backward passes each chunk runs per step (the
    microbatches). ``chunks`` are the stage's pipeline stages by index when the rank runs
    several (``stage`` then holds them all): each is sharded as its own FSDP module, and
    those in ``split_stages`` (a schedule that splits their backward into ``B`` and ``W``)
    reduce after the step's last ``W`` instead of inside the last backward. ``mesh``: the
    ``dp`` dim of a tensor-parallel stage's ``(dp, tp)`` mesh (Note [FSDP over TP]); else a
    mesh is made from ``group``. The interface
    is ``DataParallelStage``'s: ``passes``, ``should_sync``, ``end_pass``; DDP's
    communication hooks and ``join`` have no FSDP counterpart and are refused. Collective
    over ``group`` (the broadcast and sharding).
    """

    def __init__(
        self,
        stage: nn.Module,
        group: dist.ProcessGroup | None,
        options: DataParallelOptions,
        device: torch.device,
        backwards_per_step: int,
        chunks: Mapping[int, nn.Module] | None = None,
        split_stages: Collection[int] = (),
        mesh: DeviceMesh | None = None,
    ) -> None:
        if not options.fsdp:
            raise ConfigError(
                f"ShardedStage is for shard='grad-op' or 'full', got shard={options.shard!r}"
            )
        if backwards_per_step < 1:
            raise RuntimeSetupError(f"backwards_per_step must be >= 1, got {backwards_per_step}")
        self.stage = stage
        self.group = group
        self.options = options
        self.passes = 0  # forward_backward passes since the last synchronisation
        self.window = backwards_per_step * options.backward_passes_per_step
        self.hook_state: Any = None
        self._completed = False  # complete_grads ran in this window
        modules = dict(chunks) if chunks else {0: stage}
        self.tied = TiedCopies(untie_chunks([modules[s] for s in sorted(modules)]))
        broadcast_state(stage, group, local_shards=mesh is not None)
        self.units: list[nn.Module] = []
        self.chunks: list[_ShardedChunk] = []
        self._weight_params: dict[int, list[torch.Tensor]] = {}
        trainable = [
            s for s in sorted(modules) if any(p.requires_grad for p in modules[s].parameters())
        ]
        if not trainable:
            return  # nothing to shard or reduce (DataParallelStage has no DDP either)
        if mesh is None:
            world = group if group is not None else dist.group.WORLD
            assert world is not None, "the default process group is initialised"
            mesh = DeviceMesh.from_group(world, device.type)
        for index in trainable:
            module = modules[index]
            units = shard_stage(module, mesh, options)
            plan_unshards(units, overlap=device.type != "cpu")
            self.units += units
            chunk = _ShardedChunk(module, options, self.window, index in split_stages)
            self.chunks.append(chunk)
            if chunk.split:
                self._weight_params[index] = chunk.weight_params

    @contextlib.contextmanager
    def warming_up(self) -> Iterator[None]:
        """Around a compiled stage's warm-up after the wrap (Note [compiling under FSDP] in
        ``fxpipe.runtime.pipeline.compiled``; collective over the group: every replica warms up
        alike): each backward of it is a window's last, so FSDP reduces and reshards as after
        a step; then the gradients are dropped and every chunk starts its first window. Every
        unit is resharded at the end: an eval warm-up's forward (no_grad, no backward to reshard
        after it) leaves ``grad-op``'s units whole, and the optimizer, made next, must see the
        shards."""
        for chunk in self.chunks:
            chunk._last()
        try:
            yield
        finally:
            for chunk in self.chunks:
                chunk.finish()
            for unit in self.units:
                if isinstance(unit, FSDPModule):
                    unit.reshard()
            for p in self.stage.parameters():
                p.grad = None

    @property
    def weight_params(self) -> dict[int, list[torch.Tensor]]:
        """The parameters a split backward's ``W`` differentiates, by stage: FSDP's whole ones."""
        return dict(self._weight_params)

    @property
    def size(self) -> int:
        """Replicas in the data-parallel group."""
        return dist.get_world_size(self.group)

    # -- the end of an accumulation window (``end_pass``: AccumulationWindow) ------------

    def complete_grads(self) -> None:
        """At the end of a window, before the tied gradients are summed across ranks: reduce the
        split chunks' gradients (after the step's last ``W``), and give the copies of a parameter
        tied between this rank's chunks one gradient, their sum (``chunk_ties``)."""
        if self._completed:
            return
        self._completed = True
        for chunk in self.chunks:
            if chunk.split:
                chunk.reduce()
        self.tied.share_grads()

    def sync_gradients(self) -> None:
        """End the accumulation window: complete the gradients if ``complete_grads`` did not yet,
        check that FSDP reduced and resharded the fused chunks (inside the window's last
        backward), start the next window."""
        self.complete_grads()
        self._completed = False
        for chunk in self.chunks:
            done = chunk.finish()
            if done != self.window:
                raise RuntimeSetupError(
                    f"the sharded stage ran {done} backward passes in this accumulation window but expected "
                    f"{self.window} (microbatches x backward_passes_per_step), so its gradients were "
                    f"{'reduced early' if done > self.window else 'never reduced'}; run every microbatch's backward "
                    "through the stage once per step"
                )
        self.tied.own_grads()
        if self.options.broadcast_buffers:
            with torch.no_grad():
                for b in self.stage.buffers():
                    dist.broadcast(b, group=self.group, group_src=0)

    # -- what DDP has and FSDP does not ------------------------------------------------

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        raise ConfigError(
            f"shard={self.options.shard!r} reduces gradients with FSDP's reduce-scatter, which takes "
            "no DDP communication hook; use shard 'none' or 'optimizer' to register one"
        )

    def hook_state_dict(self) -> dict[str, Any] | None:
        """``None``: FSDP has no communication-hook state."""
        return None

    def load_hook_state_dict(self, data: dict[str, Any] | None) -> None:
        if data is not None:
            raise ConfigError(
                "the checkpoint holds a DDP communication hook's state, but this stage is sharded "
                f"with FSDP (shard={self.options.shard!r}), which has none; load it with the shard "
                "level it was saved with"
            )

    @contextlib.contextmanager
    def join(self, *joinables: Any, enable: bool = True) -> Iterator[None]:
        if enable:
            raise ConfigError(
                f"join() for uneven inputs is DDP's; FSDP (shard={self.options.shard!r}) has no "
                "join: give every replica the same number of steps, or use shard 'none'/'optimizer'"
            )
        yield
