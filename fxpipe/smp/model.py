"""``DistributedModel``: the seed's model wrapper, partitioned at the first ``@step`` call.

Before partitioning it holds the user's whole module (so ``model.parameters()`` can
feed an optimizer, and a full ``load_state_dict`` goes straight into it). The first
``model(...)`` inside a ``@step`` function partitions it (``fxpipe.smp.partitioning``)
with that microbatch as the example inputs; from then on ``model.module`` is this
rank's stage, whose keys are the original model's, and the original module is
released. ``model(...)`` and ``model.backward(...)`` then drive the pipeline through
``StepDriver`` (see Note [user-driven schedule] in ``fxpipe.smp.driver``).
With ``ddp: True`` and several replicas the stage is also wrapped in DDP over its
data-parallel group (``fxpipe.smp.replicas``); with ``tensor_parallel_degree`` T > 1 it is
split over its T ranks first (``fxpipe.smp.tensor_parallel``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from fxpipe.codegen.manifest import Manifest
from fxpipe.errors import ConfigError
from fxpipe.partitioner import CostModel, PartitionPlan
from fxpipe.runtime.dataparallel import DataParallelOptions
from fxpipe.runtime.dataparallel.state_dict import load_stage_state_dict, stage_state_dict
from fxpipe.runtime.dataparallel.hooks import CommHook
from fxpipe.runtime.pipeline.groups import build_groups
from fxpipe.runtime.pipeline.p2p import P2P
from fxpipe.runtime.pipeline.routes import routes_from_manifest
from fxpipe.runtime.pipeline.ties import sync_tied_grads
from fxpipe.tracer.measure.meta import is_meta_model
from fxpipe.smp.partitioning import (
    StageBuild,
    TraceOptions,
    build_stage,
    compile_stages,
    resolve_trace_device,
)
from fxpipe.smp.chunks import ChunkedDriver
from fxpipe.smp.driver import StepDriver, StepError
from fxpipe.smp.replicas import Replicas
from fxpipe.smp.state import PARTIAL_KEY, current
from fxpipe.smp.tensor_parallel import split_stages
from fxpipe.tracer.call import ModelInputs

__all__ = ["DistributedModel", "DDPOptions"]


# the seed's DDP options (DistributedModel's arguments) and the config's comm_hook / shard_optimizer_state keys
DDPOptions = DataParallelOptions


class DistributedModel(nn.Module):
    """Wraps ``module`` for pipeline-parallel training; call it and its ``backward`` inside ``@step``.

    Example::

        model = fxpipe.DistributedModel(Net())

        @fxpipe.step
        def train_step(model, data, target):
            loss = F.cross_entropy(model(data), target)
            model.backward(loss)
            return loss

    ``dynamic_dims``: the input dimensions besides the batch that follow the data, as a model file's
    ``dynamic_dims()`` gives them (``{"input_ids": {1: ("seq", 2, 512)}}``, docs/shapes.md): the build
    made at the first step then runs every length in the range, so ``@step`` may be called with
    another length each time.
    """

    def __init__(
        self,
        module: nn.Module,
        trace_device: str = "gpu",
        trace_execution_times: bool = False,
        trace_memory_usage: bool = False,
        average_grads_across_microbatches: bool = True,
        overlapping_allreduce: bool = True,
        backward_passes_per_step: int = 1,
        bucket_cap_mb: float = 25,
        broadcast_buffers: bool = True,
        gradient_as_bucket_view: bool = False,
        dynamic_dims: Mapping[str, Mapping[int, Any]] | None = None,
    ) -> None:
        super().__init__()
        st = current()
        if st.model is not None:
            raise ConfigError(
                "only one model per process can be wrapped in DistributedModel; it already wraps a "
                f"{type(st.model.module).__name__}"
            )
        if not isinstance(module, nn.Module):
            raise ConfigError(
                f"DistributedModel wraps a torch.nn.Module, got {type(module).__name__}"
            )
        self.module = module
        self.trace_options = TraceOptions(
            resolve_trace_device(trace_device),
            trace_execution_times,
            trace_memory_usage,
            dynamic_dims=dynamic_dims,
        )
        self.average_grads_across_microbatches = average_grads_across_microbatches
        self.ddp_options = st.config.data_parallel_options(
            overlapping_allreduce=overlapping_allreduce,
            backward_passes_per_step=backward_passes_per_step,
            bucket_cap_mb=bucket_cap_mb,
            broadcast_buffers=broadcast_buffers,
            gradient_as_bucket_view=gradient_as_bucket_view,
        )
        self.replicas = Replicas(self.ddp_options, st.layout.replicas, st.config.microbatches)
        self._build: StageBuild | None = None
        self._pending_partial: tuple[dict[str, Any], bool, bool] | None = (
            None  # (state, strict, partial)
        )
        self._post_hooks: OrderedDict[int, Callable[[DistributedModel], None]] = OrderedDict()
        self._driver: StepDriver | ChunkedDriver | None = None
        self._calls: Any = (
            None  # the step's microbatch calls, with several stages per rank (fxpipe.smp.chunks)
        )
        self._microbatch: int | None = None
        self._in_step = False
        self._param_names: dict[int, tuple[weakref.ref, str]] = {}
        self._primary: dict[str, str] = {}
        self._state_keys: tuple[str, ...] = ()
        self.tp_plans: dict[int, Any] = {}  # stage -> the tensor-parallel plan applied
        st.model = self

    # -- properties ------------------------------------------------------------

    @property
    def partitioned(self) -> bool:
        """Whether the first ``@step`` call has partitioned the model."""
        return self._build is not None

    @property
    def manifest(self) -> Manifest:
        """The build's manifest (after partitioning)."""
        return self._require_partitioned("manifest").manifest

    @property
    def plan(self) -> PartitionPlan | None:
        """The partition plan (after partitioning; ``None`` for a ``plan`` directory without plan.json)."""
        return self._require_partitioned("plan").plan

    @property
    def build_dir(self) -> Path | None:
        """The build directory this rank's stage was loaded from: the config's ``plan``, after
        partitioning. ``None`` for a build made at the first step, which is not kept on disk
        (Note [one plan for every rank] in ``fxpipe.smp.partitioning``): see ``manifest`` and ``plan``."""
        return self._require_partitioned("build_dir").build_dir

    def _require_partitioned(self, what: str) -> StageBuild:
        if self._build is None:
            raise StepError(
                f"{what} is only available after the model is partitioned, which happens at the "
                "first call of the @step function"
            )
        return self._build

    def register_post_partition_hook(
        self, hook: Callable[[DistributedModel], None]
    ) -> RemovableHandle:
        """Run ``hook(model)`` right after partitioning, before the first forward; ``handle.remove()`` undoes it."""
        handle = RemovableHandle(self._post_hooks)
        self._post_hooks[handle.id] = hook
        return handle

    # -- partitioning ----------------------------------------------------------

    def _record_names(self, module: nn.Module) -> None:
        """Remember every original parameter's keys, so optimizers can map them to the stage's."""
        groups: dict[int, list[str]] = {}
        for key, p in module.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(key)
            if id(p) not in self._param_names:
                self._param_names[id(p)] = (weakref.ref(p), key)
        self._primary = {key: keys[0] for keys in groups.values() for key in keys}
        self._state_keys = tuple(module.state_dict().keys())

    def _partition(self, inputs: ModelInputs) -> None:
        st = current()
        tensors: list[torch.Tensor] = []  # inside containers too (Note [tensors inside containers])
        inputs.map_tensors(lambda t: tensors.append(t))
        if not tensors or tensors[0].dim() == 0:
            raise StepError(
                f"the model must be called with tensors that have a batch dimension (dim 0), got "
                f"({inputs.describe()})"
            )
        module = self.module
        self._record_names(module)
        batch = int(tensors[0].shape[0]) * st.config.microbatches

        def tracing(flag: bool) -> None:
            st.tracing = flag

        build = build_stage(
            module,
            inputs,
            st.config,
            self.trace_options,
            rank=st.rank,
            world=st.world_size,
            mp_rank=st.mp_rank,
            device=st.device,
            batch_size=batch,
            stage_of=st.layout.stage_of,
            on_trace=tracing,
            record=st.build_record(module),
            cost=CostModel(**self.ddp_options.cost_fields(st.layout.replicas)),
        )
        if st.tp_mesh is not None:  # tensor_parallel_degree: fxpipe.smp.tensor_parallel
            self.tp_plans = split_stages(
                build.chunks,
                st.layout.tensor_parallel,
                st.tp_mesh,
                st.tp_context,
                build.build_dir,
            )
        warm_up = (  # after the split: a stage compiles as it runs (DTensor parameters)
            compile_stages(
                build, st.config, world=st.world_size, device=st.device, batch_size=batch
            )
            if st.config.compile
            else None
        )
        self.module = build.stage
        self._build = build
        self._routes = routes_from_manifest(build.manifest)
        self._groups = build_groups(st.layout, build.manifest, st.rank)
        self._p2p = P2P(
            st.rank,
            [st.pipeline_rank_of(r) for r in build.manifest.stage_ranks],
            st.timeout_s,
            st.pipeline_group,
        )  # by stage: a rank may run several
        if self._pending_partial is not None:
            state, strict, partial = self._pending_partial
            self._pending_partial = None
            self.load_state_dict({**state, PARTIAL_KEY: True} if partial else state, strict=strict)
        self.replicas.attach(
            self.module, st.dp_group, st.device, st.tp_mesh is not None
        )  # replicas start from replica 0's weights
        if warm_up is not None:  # compiled and sharded: warmed up through FSDP
            self.replicas.warm_up(warm_up)
        for wrapped in st.optimizers:
            wrapped.localize(self)
        self.replicas.start_join(self._joinables())
        for hook in list(self._post_hooks.values()):
            hook(self)

    def primary_key(self, stage_key: str) -> str:
        """The original model's first name of a parameter (tied parameters have several)."""
        return self._primary.get(stage_key, stage_key)

    def original_key(self, p: torch.Tensor) -> str | None:
        """The primary key of an original parameter object (before partitioning), if it is one."""
        entry = self._param_names.get(id(p))
        return entry[1] if entry is not None and entry[0]() is p else None

    # -- the step protocol (used by fxpipe.smp.step) --------------------

    def _begin_step(self) -> None:
        if self._in_step:
            raise StepError(
                "a @step function was called inside another @step function; call them one after another"
            )
        self._in_step, self._driver = True, None

    def _set_microbatch(self, m: int | None) -> None:
        if m is None and self._driver is not None and self._microbatch is not None:
            self._driver.microbatch_done(self._microbatch)
        self._microbatch = m

    def _end_step(self) -> None:
        """Run the remaining backwards, wait for the sends, sum tied gradients and sync the replicas."""
        st = current()

        def sum_tied_grads() -> None:
            if self._groups.ties:
                sync_tied_grads(self.module, self._groups.ties, st.rank, st.timeout_s)

        try:
            if self._driver is not None and self._driver.finish():
                self.replicas.end_step(sum_tied_grads)
        finally:
            self._in_step, self._driver, self._microbatch = False, None, None

    def _abort_step(self) -> None:
        self._in_step, self._driver, self._microbatch = False, None, None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run this rank's stage on one microbatch (only inside a ``@step`` function).

        Called like the original model, with positional and/or keyword arguments (``model(**batch)``);
        the first call is traced (Note [the traced call] in ``fxpipe.tracer.call``) and every later call
        must pass the same arguments (tensors may change, constants may not: ``CallError``).
        """
        if self._microbatch is None:
            raise StepError(
                "the DistributedModel was called outside a @step function; put model(...) and "
                "model.backward(loss) in a function decorated with @fxpipe.step"
            )
        if self._build is None:
            self._partition(ModelInputs(args, kwargs))
        inputs = self.manifest.call_spec.bind(args, kwargs)
        if self._driver is None:
            st = current()
            if self._calls is not None:
                chunks = self._require_partitioned("model(...)").chunks
                self._driver = ChunkedDriver(
                    self.manifest,
                    self._routes,
                    st.mp_rank,
                    chunks,
                    self._p2p,
                    st.device,
                    st.config.schedule,
                    st.config.microbatches,
                    self.average_grads_across_microbatches,
                    self._calls,
                )
            else:
                self._driver = StepDriver(
                    self.manifest,
                    self._routes,
                    st.mp_rank,
                    self.module,
                    self._p2p,
                    st.device,
                    st.config.schedule,
                    st.config.microbatches,
                    self.average_grads_across_microbatches,
                )
        return self._driver.forward(self._microbatch, inputs)

    def backward(
        self,
        tensors: torch.Tensor | Sequence[torch.Tensor],
        grad_tensors: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        """Backpropagate through the pipeline, like ``torch.autograd.backward(tensors, grad_tensors)``."""
        if self._microbatch is None or self._driver is None:
            raise StepError(
                "model.backward was called outside a @step function, or before model(...) in it; call "
                "model.backward(loss) inside the @step function, after model(...)"
            )
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if isinstance(grad_tensors, torch.Tensor):
            grad_tensors = [grad_tensors]
        self._driver.backward(self._microbatch, tensors, grad_tensors)

    # -- data parallelism --------------------------------------------------------

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """``DistributedDataParallel.register_comm_hook`` on this rank's stage (before or after partitioning).

        Needs ``'comm_hook': 'allreduce'`` (DDP takes one hook). Example::

            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            model.register_comm_hook(fxpipe.get_dp_process_group(), default_hooks.fp16_compress_hook)
        """
        self.replicas.register_comm_hook(state, hook)

    def comm_hook_state_dict(self) -> dict[str, Any] | None:
        """This rank's communication-hook state (PowerSGD's error feedback...), ``None`` for stateless hooks.

        It differs per rank: save it on every rank, e.g. ``fxpipe.save(model.comm_hook_state_dict(),
        f"hook.pt_{fxpipe.dp_rank()}")``, and load it with ``load_comm_hook_state_dict``.
        """
        return self.replicas.hook_state_dict()

    def load_comm_hook_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore ``comm_hook_state_dict()`` (before or after partitioning), so training resumes exactly."""
        self.replicas.load_hook_state_dict(state)

    def _joinables(self) -> list[Any]:
        return [wrapped.zero for wrapped in current().optimizers if wrapped.zero is not None]

    def join(self, enable: bool = True) -> contextlib.AbstractContextManager[None]:
        """DDP's ``join`` for replicas with uneven numbers of steps (sharded optimizers join too).

        Wrap the whole training loop; a replica that runs out of data shadows the others'
        gradient all-reduces until all are done. Collectives outside DDP and ZeRO (a
        GradScaler's, your own) are not shadowed. Example::

            with model.join():
                for data, target in my_replicas_batches:
                    train_step(model, data, target)
        """
        return self.replicas.join(self._joinables, enable)

    def cpu(self) -> DistributedModel:
        """Move this rank's stage (or, before partitioning, the whole module) to the CPU.

        Unlike the seed library it gathers nothing: ``state_dict()`` gathers the full
        model's tensors (on the CPU) from every stage.
        """
        self.module.cpu()
        return self

    # -- local views -----------------------------------------------------------

    def local_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their original keys."""
        self._require_partitioned("local_named_parameters()")
        return self.module.named_parameters()

    def local_parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters."""
        return (p for _, p in self.local_named_parameters())

    def local_named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's buffers under their original keys."""
        self._require_partitioned("local_named_buffers()")
        return self.module.named_buffers()

    def local_buffers(self) -> Iterator[torch.Tensor]:
        """This rank's buffers."""
        return (b for _, b in self.local_named_buffers())

    def local_named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        """This rank's modules under their original paths."""
        self._require_partitioned("local_named_modules()")
        return ((name, m) for name, m in self.module.named_modules() if name)

    def local_modules(self) -> Iterator[nn.Module]:
        """This rank's modules."""
        return (m for _, m in self.local_named_modules())

    # -- state dicts -----------------------------------------------------------

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's part of the state dict, marked partial (``_smp_is_partial``)."""
        self._require_partitioned("local_state_dict()")
        return {
            **stage_state_dict(self.module),
            PARTIAL_KEY: True,
        }  # FSDP shards gathered (collective)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The full model's state dict with its original keys, gathered from every stage (on the CPU).

        Collective over the pipeline: every rank of the pipeline must call it.
        """
        if self._build is None:
            return self.module.state_dict(*args, **kwargs)
        st = current()
        local = {k: v.detach().cpu() for k, v in stage_state_dict(self.module).items()}
        parts: list[Any] = [None] * st.layout.num_stages
        dist.all_gather_object(parts, local, group=st.pipeline_group)
        merged: dict[str, Any] = {}
        for part in parts:
            for k, v in part.items():
                merged.setdefault(k, v)
        ordered = {k: merged[k] for k in self._state_keys if k in merged}
        ordered.update({k: v for k, v in merged.items() if k not in ordered})
        return ordered

    def load_state_dict(  # type: ignore[override]
        self,
        state_dict: dict[str, Any],
        strict: bool = True,
        assign: bool = False,
    ) -> Any:
        """Load a full or a partial (``local_state_dict``) state dict.

        Before partitioning a full one goes into the wrapped module and a partial one is
        kept and applied right after partitioning; so is a full one when the module was built
        on the meta device (it has nowhere to hold values: each rank takes its own stage's keys,
        Note [meta tracing] in ``fxpipe.tracer.measure.meta``). After it, a full one is cut to this
        rank's keys.
        """
        state = dict(state_dict)
        partial = bool(state.pop(PARTIAL_KEY, False))
        if self._build is None:
            if partial or is_meta_model(self.module):
                self._pending_partial = (state, strict, partial)
                return nn.modules.module._IncompatibleKeys([], [])
            return self.module.load_state_dict(state, strict=strict, assign=assign)
        mine = set(self.module.state_dict())
        if partial:
            extra, missing = sorted(set(state) - mine), sorted(mine - set(state))
            if strict and (extra or missing):
                raise ConfigError(
                    f"the partial state dict does not match stage {current().mp_rank}: keys "
                    f"{(extra or missing)[:4]} are {'extra' if extra else 'missing'}. The partitioning "
                    "changed since it was saved; load a full checkpoint (saved with partial=False) "
                    "instead"
                )
            return load_stage_state_dict(self.module, state, strict=strict, assign=assign)
        missing = sorted(mine - set(state))
        if strict and missing:
            raise ConfigError(
                f"the state dict lacks keys {missing[:4]} of this model; pass strict=False to load "
                "it anyway"
            )
        return load_stage_state_dict(
            self.module, {k: v for k, v in state.items() if k in mine}, strict=strict, assign=assign
        )
