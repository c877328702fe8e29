"""``PipelineRunner``: the native training API, one instance per rank.

Each rank runs one stage of the build, or V of them for a build made with
``--virtual-stages V`` (interleaved and V-shaped schedules): ``torchrun`` starts one
process per pipeline rank, ``Manifest.num_ranks`` of them per replica.

Usage, in a script started by ``torchrun --nproc-per-node N script.py``::

    with PipelineRunner("build", loss_fn, schedule="1f1b", microbatches=4,
                        optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1)) as runner:
        for _ in range(10):
            loss = runner.step(inputs, targets)   # the same float on every rank
        val = runner.eval_step(inputs, targets)   # forward only, eval mode, no_grad

A step by hand, with clipping across the stages::

        runner.optimizer.zero_grad()
        loss = runner.forward_backward(inputs, targets)
        norm = runner.clip_grad_norm_(1.0)        # the whole model's gradient norm, on every rank
        runner.optimizer.step()

Every rank passes the whole batch (each reads the model inputs it needs itself);
only the last stage uses the targets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Concatenate, ParamSpec

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map

from fxpipe.codegen.manifest import Manifest
from fxpipe.codegen.tp_plan import TensorParallelPlan, read_tp_plan
from fxpipe.errors import BatchMismatchError, ConfigError, RuntimeSetupError
from fxpipe.runtime.dataparallel import (
    DataParallelOptions,
    ShardedStage,
    data_parallel_stage,
    stage_optimizer,
)
from fxpipe.runtime.dataparallel.fsdp_units import compile_regions
from fxpipe.partitioner.schedule import runnable_schedules
from fxpipe.partitioner.schedule.placement import placements_of
from fxpipe.runtime.pipeline.batch_agreement import compare_batch, runner_message
from fxpipe.runtime.pipeline.clipping import clip_grads_, counted_parameters, pipeline_grad_norm
from fxpipe.runtime.pipeline.comm import pairs_sends
from fxpipe.runtime.pipeline.compiled import (
    COMPILE_SCOPES,
    DEFAULT_COMPILE_SCOPE,
    CompiledStage,
    compile_rank_stages,
    warm_up_rank_stages,
)
from fxpipe.runtime.pipeline.executor import LossFn, RankExecutor
from fxpipe.runtime.pipeline.groups import build_groups, init_process_group, pick_device, this_rank
from fxpipe.runtime.pipeline.layout import RankLayout
from fxpipe.runtime.pipeline.loss import model_loss
from fxpipe.runtime.pipeline.microbatch import check_divisible, split_inputs, split_targets
from fxpipe.runtime.train.optim import SchedulerFactory
from fxpipe.runtime.train.run_options import (
    COMPILE_BACKWARDS,
    DEFAULT_COMPILE_BACKWARD,
    DEFAULT_SCHEDULE,
    DEFAULT_TIMEOUT_S,
)
from fxpipe.runtime.pipeline.p2p import P2P, peer_error
from fxpipe.runtime.pipeline.precision import (
    PipelineScaler,
    autocast_dtype,
    autocast_loss,
    autocast_stages,
)
from fxpipe.runtime.pipeline.rank_stages import (
    load_rank_stages,
    rank_module,
    rank_state_dict,
    share_tied_parameters,
)
from fxpipe.runtime.pipeline.routes import routes_from_manifest
from fxpipe.runtime.pipeline.schedule import ActionKind, Schedule, make_schedule
from fxpipe.runtime.pipeline.loss_parallel import VocabParallelLoss, loss_parallel
from fxpipe.runtime.pipeline.tensor_parallel import (
    full_state_dict,
    implicit_replication_on,
    parallelize_stage,
    stage_mesh,
    tensor_parallel_replicas,
)
from fxpipe.runtime.pipeline.ties import sync_tied_grads
from fxpipe.runtime.pipeline.schedule import validate_schedule
from fxpipe.tracer.call import ModelInputs

__all__ = ["PipelineRunner", "StageLoader", "OptimizerFactory"]

COMPILE_CACHE = "compile_cache"  # inductor's cache folder in a build directory

StageLoader = Callable[[int, torch.device], nn.Module]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def _default_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-2)


def _manifest_and_loader(
    build: str | Path | Manifest,
    stage_loader: StageLoader | None,
) -> tuple[Manifest, StageLoader]:
    """The build's manifest, and how to build a stage: ``stage_loader``, else ``fxpipe.load_stage``
    from the build directory's own files."""
    if isinstance(build, Manifest):
        if stage_loader is None:
            raise ConfigError(
                "PipelineRunner(manifest, ...) needs stage_loader=(index, device) -> stage: a "
                "manifest does not say where its stage files are; or pass the build directory"
            )
        return build, stage_loader
    build_dir = Path(build)

    def load(index: int, device: torch.device) -> nn.Module:
        from fxpipe.codegen import load_stage

        return load_stage(build_dir, index, device=device)

    return Manifest.from_json(build_dir), stage_loader or load


def _tensor_parallel_plan(
    build: str | Path | Manifest,
    tp_plan: TensorParallelPlan | str | Path | None,
    layout: RankLayout,
    dp_options: DataParallelOptions,
    schedule: Schedule,
) -> TensorParallelPlan | None:
    """The plan to apply at ``layout.tensor_parallel`` > 1: ``tp_plan`` (a plan or its file),
    else the build's ``tp_plan.json``; refuses what tensor parallelism does not combine with yet."""
    degree = layout.tensor_parallel
    if degree == 1:
        return None
    if layout.replicas > 1 and (
        dp_options.shard == "optimizer" or dp_options.comm_hook != "allreduce"
    ):
        raise ConfigError(
            f"tensor parallelism (tp {degree}) with data parallelism runs DDP (shard='none') or "
            f"FSDP (shard='grad-op' or 'full') with comm_hook='allreduce' only, not "
            f"shard={dp_options.shard!r}, comm_hook={dp_options.comm_hook!r}"
        )
    if dp_options.shard_param_dtype is not None or dp_options.shard_reduce_dtype is not None:
        raise ConfigError(
            f"tp {degree} does not combine with FSDP's shard_param_dtype/shard_reduce_dtype yet: "
            "leave them out (the stage's own precision still applies)"
        )
    if (
        layout.replicas > 1
        and dp_options.fsdp
        and (schedule.split_backward() or schedule.virtual_stages > 1)
    ):  # Note [FSDP over TP] in fxpipe.runtime.dataparallel.sharded
        raise ConfigError(
            f"tp {degree} with shard={dp_options.shard!r} runs one stage per rank and an unsplit "
            f"backward only, not schedule {schedule.name!r}: use 1f1b or gpipe, or shard='none'"
        )
    if isinstance(tp_plan, TensorParallelPlan):
        return tp_plan
    if isinstance(build, Manifest) and tp_plan is None:
        raise ConfigError(
            f"tp {degree} with a manifest needs tp_plan= (a TensorParallelPlan or its JSON file)"
        )
    return read_tp_plan(build if not isinstance(build, Manifest) else ".", tp_plan)


def _recomputed(
    recompute: Sequence[bool], manifest: Manifest, schedule: Schedule
) -> tuple[int, ...]:
    """The stages whose forward runs under ``torch.utils.checkpoint`` (the plan's ``cost.recompute``)."""
    if not any(recompute):
        return ()
    if len(recompute) != manifest.num_stages:
        raise ConfigError(
            f"recompute lists {len(recompute)} stages but the build has {manifest.num_stages}; "
            "re-plan the build"
        )
    if schedule.split_backward():
        raise ConfigError(
            f"schedule {schedule.name!r} splits the backward, which fxpipe does not combine with "
            "recomputing stages; run 1f1b, gpipe or interleaved-1f1b, or re-plan without recompute"
        )
    return tuple(s for s, flag in enumerate(recompute) if flag)


def _compile_scope(compile: bool | str) -> str:
    """The compile scope that ``PipelineRunner(compile=...)`` names (``True``: the default)."""
    if compile is True:
        return DEFAULT_COMPILE_SCOPE
    if compile not in COMPILE_SCOPES:
        raise ConfigError(
            f"compile must be True, False or a scope in {list(COMPILE_SCOPES)}, got {compile!r}"
        )
    return str(compile)


def _split_graphs(compile_backward: str) -> bool:
    """Whether ``PipelineRunner(compile_backward=...)`` cuts each compiled backward in halves."""
    if compile_backward not in COMPILE_BACKWARDS:
        raise ConfigError(
            f"compile_backward must be one of {list(COMPILE_BACKWARDS)}, got {compile_backward!r}"
        )
    return compile_backward == "halves"


def _to_device(tree: Any, device: torch.device) -> Any:
    """``tree`` with its tensors on ``device`` (the loss runs where the last stage's outputs are)."""
    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)


def _check_sharding_fits(options: DataParallelOptions, schedule: Schedule) -> None:
    """A split backward reduces a sharded chunk's gradients after the step's last W (Note
    [sharding in a pipeline]), once: not after each microbatch."""
    if options.fsdp and options.shard_reduce == "microbatch" and schedule.split_backward():
        raise ConfigError(
            f"shard_reduce='microbatch' cannot follow schedule {schedule.name!r}, which computes the "
            "weight gradients in W after the backward; use shard_reduce='step', or gpipe, 1f1b or "
            "interleaved-1f1b"
        )


def resolve_schedule(
    schedule: str | Schedule | None,
    manifest: Manifest,
    microbatches: int,
    virtual_stages: int | None = None,
) -> Schedule:
    """The schedule to run: ``schedule`` (a name or a ``Schedule``), else the build's own, and it
    must place the stages on the ranks as the build does (``virtual_stages``, if given, must be
    the build's: a build's chunks are fixed when it is partitioned)."""
    ranks, v, placements = placements_of(manifest.stage_ranks)
    fits = tuple(dict.fromkeys(s for p in placements for s in runnable_schedules(v, p)))
    if virtual_stages is not None and virtual_stages != v:
        raise ConfigError(
            f"--virtual-stages {virtual_stages} does not match the build, which has {v} stages per "
            f"rank ({manifest.num_stages} stages on {ranks} ranks); leave it out, or repartition "
            f"with `fxpipe partition --virtual-stages {virtual_stages}`"
        )
    if schedule is None:
        schedule = manifest.schedule or (DEFAULT_SCHEDULE if v == 1 else fits[0])
    if not isinstance(schedule, Schedule):
        if schedule not in fits:
            raise ConfigError(
                f"schedule {schedule!r} cannot run this build: it has {manifest.num_stages} stages, "
                f"{v} per rank placed {placements[0]!r}, which runs {list(fits)}; use one of them or "
                f"rebuild with `fxpipe partition --schedule {schedule}`"
            )
        schedule = make_schedule(schedule, ranks, microbatches, v)
    if schedule.num_microbatches != microbatches or schedule.num_stages != manifest.num_stages:
        raise RuntimeSetupError(
            f"schedule {schedule.name!r} is for {schedule.num_stages} stages x "
            f"{schedule.num_microbatches} microbatches, not {manifest.num_stages} x {microbatches}"
        )
    if schedule.stage_ranks != manifest.stage_ranks:
        raise RuntimeSetupError(
            f"schedule {schedule.name!r} places the stages on ranks {list(schedule.stage_ranks)} "
            f"but the build on {list(manifest.stage_ranks)}; use a schedule made for this build"
        )
    return schedule


_P = ParamSpec("_P")


def _releasing_the_group_on_failure(
    init: Callable[Concatenate[PipelineRunner, _P], None],
) -> Callable[Concatenate[PipelineRunner, _P], None]:
    """``PipelineRunner.__init__`` that destroys the process group it created when it fails
    after creating it (a compiled stage refused at its warm-up, say), so the caller's process can
    start another runner."""

    @functools.wraps(init)
    def run(self: PipelineRunner, *args: _P.args, **kwargs: _P.kwargs) -> None:
        try:
            init(self, *args, **kwargs)
        except BaseException:
            if getattr(self, "_owns_group", False) and dist.is_initialized():
                dist.destroy_process_group()
                self._owns_group = False
            raise

    return run


class PipelineRunner:
    """Trains this rank's stage of a build directory in a pipeline with the other ranks.

    ``build`` is the build directory, or a ``Manifest`` together with
    ``stage_loader(index, device)`` that builds stage ``index`` (stages made another way:
    tests, benchmarks). ``schedule`` is a name in ``SCHEDULE_NAMES`` that fits the build's
    placement, a ``Schedule`` of your own (validated first), or ``None``: the build's.
    Gradients are averaged over the ``microbatches`` (summed with
    ``average_microbatch_grads=False``). Each
    rank's optimizer (``optimizer_factory(params)``, default SGD lr=0.01) updates only
    its own stage's parameters. A peer that dies or hangs raises ``PeerError`` after at
    most ``timeout_s`` seconds. Targets are cut into microbatches along dim 0 unless
    ``target_batch_dims`` gives the batch dim of each leaf of the (nested) targets
    (``None``: shared by every microbatch). With ``loss_fn=None`` the loss is the one the
    model computes itself (``output.loss``, e.g. of a model given ``labels=``;
    ``fxpipe.runtime.pipeline.loss``), and the targets are unused. ``scheduler_factory(optimizer)``
    makes a learning-rate scheduler that ``step`` advances after each optimizer step;
    ``max_grad_norm`` clips the global gradient norm before each optimizer step
    (``clip_grad_norm_``; the norm is kept in ``last_grad_norm``). ``precision="bf16"`` runs
    each stage's forward and the loss under bf16 autocast (``fxpipe.runtime.pipeline.precision``);
    ``"fp16"`` under fp16 autocast with one loss scale for the job (``scaler``): a step with an
    inf or NaN gradient on any rank is skipped on every rank. Every batch given to ``step``,
    ``forward_backward`` and ``eval_step`` is compared across the pipeline's ranks first (one
    small collective; Note [one batch per pipeline] in ``fxpipe.runtime.pipeline.batch_agreement``):
    ranks given different rows stop with a ``BatchMismatchError`` naming the step and the tensor;
    ``check_batches=False`` skips it.
    ``compile=True`` (or a scope, ``"stage"`` or ``"regional"``) runs each stage under
    ``torch.compile``, compiled before the first step at ``compile_microbatch_size`` (default
    the build's microbatch) with inductor's cache in ``compile_cache`` (default
    ``BUILD/compile_cache``); ``compiled`` reports each stage's compile
    (``fxpipe.runtime.pipeline.compiled``). ``compile_eval=True`` compiles ``eval_step``'s graphs
    then too, for a job that will evaluate (Note [compiled eval graphs]); each compiled stage is
    compared with its eager code at the warm-up unless ``compile_check=False`` (Note [checking a
    compiled stage at the warm-up]).
    """

    @_releasing_the_group_on_failure
    def __init__(
        self,
        build: str | Path | Manifest,
        loss_fn: LossFn | None,
        *,
        stage_loader: StageLoader | None = None,
        schedule: str | Schedule | None = None,
        microbatches: int = 1,
        optimizer_factory: OptimizerFactory | None = None,
        average_microbatch_grads: bool = True,
        device: str | torch.device | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        data_parallel: DataParallelOptions | None = None,
        target_batch_dims: Sequence[int | None] | None = None,
        virtual_stages: int | None = None,
        recompute: Sequence[bool] = (),
        scheduler_factory: SchedulerFactory | None = None,
        max_grad_norm: float | None = None,
        precision: str = "fp32",
        check_batches: bool = True,
        compile: bool | str = False,
        compile_backward: str = DEFAULT_COMPILE_BACKWARD,
        compile_cache: str | Path | None = None,
        compile_microbatch_size: int | None = None,
        compile_eval: bool = False,
        compile_check: bool = True,
        tensor_parallel: int = 1,
        tp_plan: TensorParallelPlan | str | Path | None = None,
    ) -> None:
        self._owns_group = False
        self._tp_context = contextlib.ExitStack()
        self.check_batches = check_batches
        self._calls = {"step": 0, "forward_backward": 0, "eval_step": 0}
        manifest, load = _manifest_and_loader(build, stage_loader)
        self.target_batch_dims = target_batch_dims
        rank, world, local_rank = this_rank()
        if microbatches < 1:
            raise RuntimeSetupError(f"microbatches must be >= 1, got {microbatches}")
        self.schedule = resolve_schedule(schedule, manifest, microbatches, virtual_stages)
        self.layout = RankLayout.for_world(
            world, manifest.num_ranks, manifest.virtual_stages, tensor_parallel
        )
        dp_options = data_parallel or DataParallelOptions()
        resolved_tp = _tensor_parallel_plan(build, tp_plan, self.layout, dp_options, self.schedule)
        dp_options.check_replicas(self.layout.replicas)  # before any communication
        _check_sharding_fits(dp_options, self.schedule)
        self.manifest = manifest
        self.rank, self.world_size = rank, world
        self.pipeline_rank = self.layout.stage_of(rank)
        self.replica = self.layout.replica_of(rank)
        self.tp_rank = self.layout.tp_of(rank)
        self.loss_fn = loss_fn if loss_fn is not None else model_loss
        autocast = autocast_dtype(precision)  # checked before any communication
        scope = _compile_scope(compile) if compile else None  # so are these two
        split_graphs = _split_graphs(compile_backward)
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ConfigError(f"max_grad_norm must be > 0, got {max_grad_norm!r}")
        self.timeout_s = timeout_s
        self.microbatches = microbatches
        self.routes = routes_from_manifest(manifest)
        validate_schedule(self.schedule, self.routes.links())
        self.device = pick_device(device, local_rank)
        self._owns_group = init_process_group(self.device, timeout_s)
        self.groups = build_groups(self.layout, manifest, rank)
        self.tp_plan = resolved_tp  # every stage's, for the log: fxpipe.codegen.tp_plan
        self.vocab_loss: VocabParallelLoss | None = None  # the loss of sharded logits
        # the stage's (dp, tp) mesh: fxpipe.runtime.pipeline.tensor_parallel.stage_mesh
        self.stage_mesh = stage_mesh(self.layout, self.device) if resolved_tp is not None else None
        self.tp_mesh = self.stage_mesh["tp"] if self.stage_mesh is not None else None
        self.stages = load_rank_stages(manifest, self.pipeline_rank, load, self.device)
        if (
            resolved_tp is not None and self.tp_mesh is not None
        ):  # fxpipe.runtime.pipeline.tensor_parallel
            for index, module in self.stages.items():
                parallelize_stage(
                    module, resolved_tp.stage(index).for_degree(tensor_parallel), self.tp_mesh
                )
            # each stage's parallelize_module made its own DTensor of a parameter the rank's
            # chunks shared (ZBV's first and last stage on one rank): share them again, or the
            # tie gets only one chunk's gradient (Note [ties under tensor parallelism])
            share_tied_parameters(self.stages, manifest)
            self._tp_context.enter_context(implicit_replication_on())
            loss_stage = self.routes.loss_stage
            if (
                loss_stage in self.stages
                and resolved_tp.stage(loss_stage).for_degree(tensor_parallel).head
            ):  # logits sharded over the vocabulary: fxpipe.runtime.pipeline.loss_parallel
                self.vocab_loss = VocabParallelLoss(self.loss_fn)
                self.loss_fn = self.vocab_loss
        self.stage_index = min(self.stages)
        if autocast is not None:  # before DDP/FSDP wrap them: fxpipe.runtime.pipeline.precision
            autocast_stages(self.stages.values(), self.device, autocast)
            self.loss_fn = autocast_loss(self.loss_fn, self.device, autocast)
        recomputed = _recomputed(recompute, manifest, self.schedule)
        for module in self.stages.values():
            module.train()
        self.compiled: list[CompiledStage] = []
        warm_mb = compile_microbatch_size or manifest.microbatch_size
        regions = None  # sharded: the FSDP units compiled inside, warmed up after the wrap
        if scope is not None:  # after autocast (compiled under it), before DDP/FSDP wrap the stages
            # Note [compile scope], Note [compiling under FSDP]
            regions = compile_regions(self.stages, dp_options, self.layout.replicas)
            self.compiled = compile_rank_stages(
                manifest,
                self.stages,
                self.device,
                warm_mb,
                scope=scope,
                recompute=recomputed,
                split_backward=bool(self.schedule.split_backward()),
                split_graphs=split_graphs,
                cache_explicit=compile_cache is not None,
                cache_dir=compile_cache
                if compile_cache is not None or isinstance(build, Manifest)
                else Path(build) / COMPILE_CACHE,
                regions=regions,
                warm_up=regions is None,
                eval_graphs=compile_eval,
                autocast=autocast,
                check=compile_check,
            )
        self.stage = rank_module(
            self.stages
        )  # the rank's stages as one module (the stage itself if one)
        self.stage.train()
        # data parallelism over the replicas of this rank (DDP or FSDP, by shard level): fxpipe.runtime.dataparallel
        self.data_parallel = (
            tensor_parallel_replicas(self.stage, self.groups.data_parallel, dp_options, self.device)
            if self.layout.replicas > 1 and self.tp_mesh is not None and not dp_options.fsdp
            else data_parallel_stage(
                self.stage,
                self.groups.data_parallel,
                dp_options,
                self.device,
                microbatches,
                self.stages,
                {s for s, _ in self.schedule.split_backward()},
                mesh=self.stage_mesh["dp"] if self.stage_mesh is not None else None,
            )
            if self.layout.replicas > 1
            else None
        )
        if regions is not None:  # Note [compiling under FSDP]
            assert isinstance(self.data_parallel, ShardedStage), "compile_regions: sharded"
            with self.data_parallel.warming_up():
                warm_up_rank_stages(
                    manifest,
                    self.stages,
                    self.device,
                    warm_mb,
                    self.compiled,
                    recomputed,
                    compile_eval,
                    autocast,
                    compile_check,
                    (dp_options.shard_param_dtype, dp_options.shard_reduce_dtype),
                )
        self.optimizer = stage_optimizer(
            self.stage, optimizer_factory or _default_optimizer, self.data_parallel
        )
        p2p = P2P(
            rank,
            [self.layout.rank_of(r, self.replica, self.tp_rank) for r in manifest.stage_ranks],
            timeout_s,
            self.groups.pipeline,
        )
        self.executor = RankExecutor(
            manifest,
            self.routes,
            self.pipeline_rank,
            self.stages,
            self.schedule,
            p2p,
            self.device,
            average_microbatch_grads,
            pair_sends=pairs_sends(self.device),
            recompute=recomputed,
            autocast=autocast,
            weight_params=self.data_parallel.weight_params if self.data_parallel else None,
        )
        self.loss_rank = self.layout.rank_of(
            manifest.stage_ranks[self.routes.loss_stage], self.replica, self.tp_rank
        )
        self.scheduler = (
            scheduler_factory(self.optimizer)
            if scheduler_factory and self.optimizer is not None
            else None
        )
        self.scaler = PipelineScaler(self.device, self.optimizer) if precision == "fp16" else None
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: float | None = None
        self._p2p = p2p
        self._evaluator: RankExecutor | None = None
        self._autocast = autocast

    # -- training --------------------------------------------------------------

    def _microbatches(
        self,
        inputs: ModelInputs | Mapping[str, Any] | torch.Tensor | Sequence[torch.Tensor],
        targets: Any,
        call: str,
    ) -> tuple[list[tuple[torch.Tensor, ...]], list[Any] | None]:
        """The step's inputs bound to the build and cut into microbatches; the targets too, on the
        loss rank. ``call``: the method given them, counted for the batch check's message."""
        if (
            isinstance(inputs, (ModelInputs, Mapping))
            or (
                isinstance(inputs, (tuple, list))
                and not all(isinstance(x, torch.Tensor) for x in inputs)
            )
        ):  # a call, not the build's tensors: containers are flattened (Note [tensors inside containers])
            inputs = self.manifest.call_spec.bind_any(inputs)
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        self._calls[call] += 1
        if self.check_batches:
            n = self._calls[call]
            self._check_batch(
                inputs, targets, f"at step {n}" if call == "step" else f"at {call} call {n}"
            )
        dims = [t.batch_dim for t in self.manifest.inputs]
        batched = [t.shape[d] for t, d in zip(inputs, dims) if d is not None]
        if batched:
            self.manifest.check_static_batch(check_divisible(batched[0], self.microbatches))
        mb_inputs = split_inputs(inputs, dims, self.microbatches)
        mb_targets = (
            split_targets(
                _to_device(targets, self.device), self.microbatches, self.target_batch_dims
            )
            if self.executor.holds_loss
            else None
        )
        return mb_inputs, mb_targets

    def pipeline_ranks(self) -> list[int]:
        """The global ranks of this rank's pipeline (its replica and tensor-parallel rank), in stage order."""
        return [
            self.layout.rank_of(s, self.replica, self.tp_rank)
            for s in range(self.manifest.num_ranks)
        ]

    def _check_batch(self, inputs: Any, targets: Any, when: str) -> None:
        """Stop every rank of the pipeline if they were given different batches (collective)."""
        found = compare_batch(
            inputs,
            targets,
            group=self.groups.pipeline,
            ranks=self.pipeline_ranks(),
            device=self.device,
            rank=self.rank,
            timeout_s=self.timeout_s,
        )
        if found is not None:
            raise BatchMismatchError(runner_message(found, when, self.replica))

    def _shared_loss(self, losses: list[torch.Tensor], doing: str) -> Callable[[], float]:
        """Start broadcasting the mean of the loss rank's microbatch losses over the pipeline
        (collective); the returned call waits for it and gives its value. A step posts it before
        the tied-gradient sums and the optimizer step and waits after them, so the message is
        never on the step's critical path."""
        is_last = self.executor.holds_loss
        loss = (
            torch.stack(losses).mean().to(self.device)
            if is_last
            else torch.zeros((), device=self.device)
        )
        loss = loss.float()
        try:
            work = dist.broadcast(
                loss, src=self.loss_rank, group=self.groups.pipeline, async_op=True
            )
        except RuntimeError as exc:
            raise peer_error(exc, self.rank, doing, self.timeout_s) from exc

        def value() -> float:
            try:
                if work is not None:
                    work.wait()
            except RuntimeError as exc:
                raise peer_error(exc, self.rank, doing, self.timeout_s) from exc
            return float(loss.item())

        return value

    def _loss_parallel(self) -> contextlib.AbstractContextManager[None]:
        """torch's ``loss_parallel()`` over a step's forward and backward on the ranks of a
        vocabulary-parallel head's stage (Note [which losses run in parallel])."""
        return loss_parallel() if self.vocab_loss is not None else contextlib.nullcontext()

    def forward_backward(
        self,
        inputs: ModelInputs | Mapping[str, Any] | torch.Tensor | Sequence[torch.Tensor],
        targets: Any = None,
    ) -> float:
        """Forward and backward over all microbatches, without an optimizer step.

        ``inputs``: the build's tensor inputs in the manifest's order (a tensor or a
        sequence), or the model's call (a dict of keyword arguments or a ``ModelInputs``,
        bound as the original forward would: Note [the traced call] in ``fxpipe.tracer.call``).
        Gradients accumulate into ``.grad`` (tied copies summed across their stages).
        Returns the loss averaged over microbatches, on every rank.
        """
        return self._forward_backward(inputs, targets, "forward_backward")()

    def _forward_backward(
        self,
        inputs: ModelInputs | Mapping[str, Any] | torch.Tensor | Sequence[torch.Tensor],
        targets: Any,
        call: str,
    ) -> Callable[[], float]:
        """``forward_backward``, its loss still in flight: the returned call waits for it."""
        mb_inputs, mb_targets = self._microbatches(inputs, targets, call)
        scaler = self.scaler
        loss_fn = self.loss_fn if scaler is None else scaler.scaled(self.loss_fn)
        with self._loss_parallel():
            losses = self.executor.run(mb_inputs, mb_targets, loss_fn)
        shared = self._shared_loss(losses, "receiving the step's loss from the last stage")
        scale = scaler.scale if scaler is not None else 1.0  # before the step changes it
        dp = self.data_parallel
        if dp is None or dp.should_sync():  # tied copies are summed once per accumulation window
            if dp is not None:
                dp.complete_grads()  # FSDP: reduced after the step's last W, tied chunk copies summed
            for stage, tie in zip(self.groups.tie_stages, self.groups.ties):
                sync_tied_grads(self.stages[stage], (tie,), self.rank, self.timeout_s)
        if dp is not None:
            dp.end_pass()  # after the step's last W: every gradient is complete
        return lambda: shared() / scale  # the fp16 scale is a power of two: exact

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the gradients of the whole pipeline to a global ``norm_type``-norm of ``max_norm``.

        Collective over the pipeline: call it on every rank after ``forward_backward`` (and
        before the optimizer step). The norm is that of the one-process model's gradient
        (tied parameters counted once; ``fxpipe.runtime.pipeline.clipping``), the same on every rank
        and every replica, and is returned like ``torch.nn.utils.clip_grad_norm_``'s. With fp16
        the gradients are unscaled first (inf when some rank overflowed; the step is then skipped).
        """
        if self.scaler is not None:
            self.scaler.unscale_()
        total = pipeline_grad_norm(
            counted_parameters(self.manifest, self.stages),
            norm_type,
            self.groups.pipeline,
            self.device,
            self.rank,
            self.timeout_s,
            self.tp_mesh.get_group() if self.tp_mesh is not None else None,
        )
        clip_grads_(list(self.stage.parameters()), total, max_norm)
        self.last_grad_norm = float(total.item())
        return self.last_grad_norm

    def eval_step(
        self,
        inputs: ModelInputs | Mapping[str, Any] | torch.Tensor | Sequence[torch.Tensor],
        targets: Any = None,
    ) -> float:
        """The loss of one batch in eval mode, forward only under ``torch.no_grad``, on every rank.

        Runs the forward actions of the training schedule (the same order, no backward),
        with every stage in ``eval()`` mode (dropout off, batch norm on running statistics);
        the stages are back in train mode afterwards and no gradient or optimizer state changes.
        The loss rank's mean microbatch loss is broadcast over the pipeline, as ``step`` does.
        """
        if self._evaluator is None:
            forward = Schedule(
                f"{self.schedule.name}-forward",
                self.schedule.num_stages,
                self.schedule.num_microbatches,
                tuple(
                    tuple(a for a in acts if a.kind is ActionKind.FORWARD)
                    for acts in self.schedule.actions
                ),
                self.schedule.stage_ranks,
            )
            # no validate_schedule (it wants every B): the forwards of a valid schedule, in the same order,
            # only wait on earlier forwards, and sends never block, so they finish whenever the schedule does
            self._evaluator = RankExecutor(
                self.manifest,
                self.routes,
                self.pipeline_rank,
                self.stages,
                forward,
                self._p2p,
                self.device,
                pair_sends=pairs_sends(self.device),
                autocast=self._autocast,
            )
        mb_inputs, mb_targets = self._microbatches(inputs, targets, "eval_step")
        was_training = self.stage.training
        self.stage.eval()
        try:
            with torch.no_grad(), self._loss_parallel():
                losses = self._evaluator.run(mb_inputs, mb_targets, self.loss_fn)
        finally:
            for worker in self._evaluator.workers.values():
                for m in range(self.microbatches):
                    worker.discard(m)
            self.stage.train(was_training)
        return self._shared_loss(losses, "receiving the evaluation loss from the last stage")()

    def step(
        self,
        inputs: ModelInputs | Mapping[str, Any] | torch.Tensor | Sequence[torch.Tensor],
        targets: Any = None,
    ) -> float:
        """One training step: zero grads, forward/backward all microbatches, optimizer step.

        With data-parallel ``backward_passes_per_step = k`` gradients accumulate over k
        calls and only every k-th call all-reduces them and steps the optimizer. With
        ``max_grad_norm`` the gradients are clipped first; a scheduler steps after the optimizer
        (also after a step that fp16's scaler skipped, as torch's GradScaler examples do).
        """
        dp = self.data_parallel
        if self.optimizer is not None and (dp is None or dp.passes == 0):
            self.optimizer.zero_grad(set_to_none=True)
        loss = self._forward_backward(
            inputs, targets, "step"
        )  # its broadcast overlaps the optimizer step
        if dp is None or dp.passes == 0:
            if (
                self.max_grad_norm is not None
            ):  # collective: every rank, with or without an optimizer
                self.clip_grad_norm_(self.max_grad_norm)
            if self.scaler is not None:  # collective: every rank agrees whether to step
                self.scaler.step()
            elif self.optimizer is not None:
                self.optimizer.step()
            if self.optimizer is not None:
                if self.scheduler is not None:
                    self.scheduler.step()
        return loss()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers under the original model's keys (all its stages);
        with tensor parallelism the split ones gathered whole (collective over the tp group)."""
        state = rank_state_dict(self.stages)
        return full_state_dict(state) if self.tp_mesh is not None else state

    # -- lifetime --------------------------------------------------------------

    def close(self) -> None:
        """Destroy the process group if this runner created it."""
        self._tp_context.close()
        if getattr(self, "_owns_group", False) and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False

    def __enter__(self) -> PipelineRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
