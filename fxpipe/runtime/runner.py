"""``PipelineRunner``: the native training API, one instance per rank (one stage each).

Usage, in a script started by ``torchrun --nproc-per-node N script.py``::

    with PipelineRunner("build", loss_fn, schedule="1f1b", microbatches=4,
                        optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1)) as runner:
        for _ in range(10):
            loss = runner.step(inputs, targets)   # the same float on every rank

Every rank passes the whole batch (each reads the model inputs it needs itself);
only the last stage uses the targets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map

from fxpipe.codegen.manifest import Manifest
from fxpipe.errors import ConfigError, RuntimeSetupError
from fxpipe.runtime.dataparallel import DataParallelOptions, data_parallel_stage, stage_optimizer
from fxpipe.runtime.executor import LossFn, StageExecutor
from fxpipe.runtime.groups import build_groups, init_process_group, pick_device, this_rank
from fxpipe.runtime.layout import RankLayout
from fxpipe.runtime.microbatch import check_divisible, split_inputs, split_targets
from fxpipe.runtime.options import DEFAULT_SCHEDULE, DEFAULT_TIMEOUT_S
from fxpipe.runtime.p2p import P2P, peer_error
from fxpipe.runtime.routes import routes_from_manifest
from fxpipe.runtime.schedule import Schedule, make_schedule
from fxpipe.runtime.ties import sync_tied_grads
from fxpipe.runtime.validate import validate_schedule

__all__ = ["PipelineRunner", "StageLoader", "OptimizerFactory"]

StageLoader = Callable[[int, torch.device], nn.Module]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def _default_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-2)


def _manifest_and_loader(build: str | Path | Manifest, stage_loader: StageLoader | None,
                         ) -> tuple[Manifest, StageLoader]:
    """The build's manifest, and how to build a stage: ``stage_loader``, else ``fxpipe.load_stage``
    from the build directory's own files."""
    if isinstance(build, Manifest):
        if stage_loader is None:
            raise ConfigError("PipelineRunner(manifest, ...) needs stage_loader=(index, device) -> stage: a "
                              "manifest does not say where its stage files are; or pass the build directory")
        return build, stage_loader
    build_dir = Path(build)

    def load(index: int, device: torch.device) -> nn.Module:
        from fxpipe.codegen import load_stage

        return load_stage(build_dir, index, device=device)

    return Manifest.from_json(build_dir), stage_loader or load


def _to_device(tree: Any, device: torch.device) -> Any:
    """``tree`` with its tensors on ``device`` (the loss runs where the last stage's outputs are)."""
    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)


class PipelineRunner:
    """Trains this rank's stage of a build directory in a pipeline with the other ranks.

    ``build`` is the build directory, or a ``Manifest`` together with
    ``stage_loader(index, device)`` that builds stage ``index`` (stages made another way:
    tests, benchmarks). ``schedule`` is ``"gpipe"``, ``"1f1b"`` or a ``Schedule``.
    Gradients are averaged over the ``microbatches`` (summed with
    ``average_microbatch_grads=False``). Each
    rank's optimizer (``optimizer_factory(params)``, default SGD lr=0.01) updates only
    its own stage's parameters. A peer that dies or hangs raises ``PeerError`` after at
    most ``timeout_s`` seconds. Targets are cut into microbatches along dim 0 unless
    ``target_batch_dims`` gives the batch dim of each leaf of the (nested) targets
    (``None``: shared by every microbatch).
    """

    def __init__(self, build: str | Path | Manifest, loss_fn: LossFn, *, stage_loader: StageLoader | None = None,
                 schedule: str | Schedule = DEFAULT_SCHEDULE, microbatches: int = 1,
                 optimizer_factory: OptimizerFactory | None = None, average_microbatch_grads: bool = True,
                 device: str | torch.device | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 data_parallel: DataParallelOptions | None = None,
                 target_batch_dims: Sequence[int | None] | None = None) -> None:
        self._owns_group = False
        manifest, load = _manifest_and_loader(build, stage_loader)
        self.target_batch_dims = target_batch_dims
        rank, world, local_rank = this_rank()
        self.layout = RankLayout.for_world(world, manifest.num_stages)
        dp_options = data_parallel or DataParallelOptions()
        dp_options.check_replicas(self.layout.replicas)  # before any communication
        if microbatches < 1:
            raise RuntimeSetupError(f"microbatches must be >= 1, got {microbatches}")
        self.manifest = manifest
        self.rank, self.world_size = rank, world
        self.stage_index = self.layout.stage_of(rank)
        self.replica = self.layout.replica_of(rank)
        self.loss_fn = loss_fn
        self.timeout_s = timeout_s
        self.microbatches = microbatches
        self.routes = routes_from_manifest(manifest)
        self.schedule = schedule if isinstance(schedule, Schedule) else make_schedule(
            schedule, manifest.num_stages, microbatches)
        if self.schedule.num_microbatches != microbatches or self.schedule.num_stages != manifest.num_stages:
            raise RuntimeSetupError(
                f"schedule {self.schedule.name!r} is for {self.schedule.num_stages} stages x "
                f"{self.schedule.num_microbatches} microbatches, not {manifest.num_stages} x {microbatches}")
        validate_schedule(self.schedule, self.routes.links())
        self.device = pick_device(device, local_rank)
        self._owns_group = init_process_group(self.device, timeout_s)
        self.groups = build_groups(self.layout, manifest, rank)
        self.stage = load(self.stage_index, self.device)
        self.stage.train()
        # data parallelism over the replicas of this stage (DDP or FSDP, by shard level): fxpipe.runtime.dataparallel
        self.data_parallel = (data_parallel_stage(self.stage, self.groups.data_parallel, dp_options, self.device,
                                                  microbatches) if self.layout.replicas > 1 else None)
        self.optimizer = stage_optimizer(self.stage, optimizer_factory or _default_optimizer, self.data_parallel)
        p2p = P2P(rank, self.layout.pipeline_ranks(self.replica), timeout_s, self.groups.pipeline)
        self.executor = StageExecutor(manifest, self.routes, self.stage_index, self.stage, self.schedule, p2p,
                                      self.device, average_microbatch_grads)

    # -- training --------------------------------------------------------------

    def forward_backward(self, inputs: torch.Tensor | Sequence[torch.Tensor], targets: Any) -> float:
        """Forward and backward over all microbatches, without an optimizer step.

        Gradients accumulate into ``.grad`` (tied copies summed across their stages).
        Returns the loss averaged over microbatches, on every rank.
        """
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        dims = [t.batch_dim for t in self.manifest.inputs]
        batched = [t.shape[d] for t, d in zip(inputs, dims) if d is not None]
        if batched:
            check_divisible(batched[0], self.microbatches)
        mb_inputs = split_inputs(inputs, dims, self.microbatches)
        is_last = self.stage_index == self.routes.loss_stage
        mb_targets = (split_targets(_to_device(targets, self.device), self.microbatches, self.target_batch_dims)
                      if is_last else None)
        losses = self.executor.run(mb_inputs, mb_targets, self.loss_fn)
        dp = self.data_parallel
        if dp is None or dp.should_sync():  # tied copies are summed once per accumulation window
            sync_tied_grads(self.stage, self.groups.ties, self.rank, self.timeout_s)
        if dp is not None:
            dp.end_pass()
        loss = torch.stack(losses).mean().to(self.device) if is_last else torch.zeros((), device=self.device)
        loss = loss.float()
        try:
            dist.broadcast(loss, src=self.layout.rank_of(self.routes.loss_stage, self.replica),
                           group=self.groups.pipeline)
        except RuntimeError as exc:
            raise peer_error(exc, self.rank, "receiving the step's loss from the last stage", self.timeout_s) from exc
        return float(loss.item())

    def step(self, inputs: torch.Tensor | Sequence[torch.Tensor], targets: Any) -> float:
        """One training step: zero grads, forward/backward all microbatches, optimizer step.

        With data-parallel ``backward_passes_per_step = k`` gradients accumulate over k
        calls and only every k-th call all-reduces them and steps the optimizer.
        """
        dp = self.data_parallel
        if self.optimizer is not None and (dp is None or dp.passes == 0):
            self.optimizer.zero_grad(set_to_none=True)
        loss = self.forward_backward(inputs, targets)
        if self.optimizer is not None and (dp is None or dp.passes == 0):
            self.optimizer.step()
        return loss

    # -- lifetime --------------------------------------------------------------

    def close(self) -> None:
        """Destroy the process group if this runner created it."""
        if getattr(self, "_owns_group", False) and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False

    def __enter__(self) -> PipelineRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
