"""The training loop of one rank under ``fxpipe run``: SGD on the model file's example batch, measured.

Trains the build directory's model with SGD on ``example_inputs(B)`` and
``example_targets(B)`` (the same batch every step) and the model file's ``loss_fn``, or
without one on the loss the model computes itself (``fxpipe.runtime.loss``). With
``N = stages x R`` ranks there are R data-parallel replicas of the pipeline, each on its
own rows of the batch (``fxpipe.runtime.data``). Rank 0 prints the loss (averaged over
replicas) and throughput of every step and writes ``DIR/run.json`` (a ``RunRecord``);
after the timed steps every rank trains one more (untimed, unreported) accumulation
window to measure its peak tensor memory (``fxpipe.runtime.memory``).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.codegen.manifest import Manifest
from fxpipe.errors import RuntimeSetupError
from fxpipe.runtime.data import example_batch, model_source, replica_batch, target_batch_dims
from fxpipe.runtime.memory import peak_memory_bytes, training_peak_tensor_bytes
from fxpipe.runtime.microbatch import check_divisible
from fxpipe.runtime.options import RunOptions
from fxpipe.runtime.p2p import peer_error
from fxpipe.runtime.record import RunRecord, read_build_plan
from fxpipe.runtime.runner import PipelineRunner

__all__ = ["train", "resolve_sizes"]


def resolve_sizes(options: RunOptions, manifest: Manifest, world_size: int) -> tuple[int, int, int]:
    """(batch of one replica, microbatches, replicas): the options' values, else the build's
    and ``world_size / stages`` (Note [None is resolved where it is known] in ``fxpipe.runtime.options``)."""
    batch = options.batch_size or manifest.batch_size
    microbatches = options.microbatches or manifest.microbatches
    check_divisible(batch, microbatches)
    stages = manifest.num_ranks  # processes per pipeline: V stages (chunks) each
    replicas = options.dp if options.dp is not None else max(world_size // stages, 1)
    if world_size != stages * replicas:
        raise RuntimeSetupError(f"--dp {replicas} needs {stages} stages x {replicas} = {stages * replicas} ranks, "
                                f"but WORLD_SIZE is {world_size}; launch torchrun with --nproc-per-node "
                                f"{stages * replicas} or drop --dp")
    return batch, microbatches, replicas


def _mean_over_replicas(loss: float, runner: PipelineRunner) -> float:
    """This step's loss averaged over the replicas (each rank holds its own replica's)."""
    if runner.layout.replicas == 1:
        return loss
    total = torch.tensor(loss, dtype=torch.float32, device=runner.device)
    try:
        dist.all_reduce(total, group=runner.groups.data_parallel)
    except RuntimeError as exc:
        raise peer_error(exc, runner.rank, "averaging the step's loss over the replicas", runner.timeout_s) from exc
    return float(total.item()) / runner.layout.replicas


def train(build_dir: Path, options: RunOptions, out: Path | None = None) -> RunRecord:
    """Train ``options.steps`` steps on this rank; rank 0 writes the record to ``out``
    (default ``build_dir/run.json``). Every rank returns the record."""
    manifest = Manifest.from_json(build_dir)
    plan = read_build_plan(build_dir)
    source = model_source(build_dir, manifest)
    world = int(os.environ.get("WORLD_SIZE", manifest.num_ranks))
    batch, microbatches, replicas = resolve_sizes(options, manifest, world)
    dp = options.data_parallel
    every_replica = example_batch(source, manifest, batch * replicas)
    target_dims = target_batch_dims(source, batch) if source.has_loss_fn else None
    lr = options.lr
    with PipelineRunner(build_dir, source.loss_fn if source.has_loss_fn else None, schedule=options.schedule, microbatches=microbatches,
                        optimizer_factory=lambda params: torch.optim.SGD(params, lr=lr),
                        device=options.device, timeout_s=options.timeout_s, data_parallel=dp,
                        target_batch_dims=target_dims, virtual_stages=options.virtual_stages,
                        recompute=plan.cost.recompute if plan is not None else ()) as runner:
        schedule = runner.schedule.name
        inputs, targets = replica_batch(*every_replica, [t.batch_dim for t in manifest.inputs], runner.replica, batch,
                                        target_dims)
        lead = runner.rank == 0
        samples = batch * replicas
        if lead:
            sync = f"shard {dp.shard}" if dp.shard != "none" else f"comm hook {dp.comm_hook}"
            dp_note = (f" x {replicas} replicas ({sync})" if replicas > 1 else "")
            per_replica = " per replica" if replicas > 1 else ""
            print(f"fxpipe run: {manifest.num_stages} stages{dp_note} on {runner.world_size} ranks "
                  f"({runner.device.type}), schedule {schedule}, batch {batch}{per_replica} = "
                  f"{microbatches} x {batch // microbatches}", flush=True)
        losses, seconds = [], []
        for k in range(options.steps):
            start = time.perf_counter()
            loss = runner.step(inputs, targets)
            seconds.append(time.perf_counter() - start)
            losses.append(_mean_over_replicas(loss, runner))  # outside the timed step
            if lead:
                print(f"step {k + 1:4d}/{options.steps}  loss {losses[-1]:.6f}  {seconds[-1] * 1e3:8.2f} ms  "
                      f"{samples / seconds[-1]:10.1f} samples/s", flush=True)
        tensor_peak = training_peak_tensor_bytes(runner, inputs, targets, dp.backward_passes_per_step)
        peaks: list[Any] = [None] * runner.world_size
        try:  # over the whole world: one figure per rank, every replica included
            dist.all_gather_object(peaks, (peak_memory_bytes(runner.device), tensor_peak))
        except RuntimeError as exc:
            raise peer_error(exc, runner.rank, "gathering peak memory", options.timeout_s) from exc
        steady = statistics.median(seconds[1:] or seconds)
        record = RunRecord(
            losses=tuple(losses), step_seconds=tuple(seconds), median_step_ms=steady * 1e3,
            samples_per_second=samples / steady, schedule=schedule, microbatches=microbatches,
            batch_size=batch, lr=lr, world_size=runner.world_size, num_stages=manifest.num_stages,
            device=runner.device.type, backend=dist.get_backend(),
            predicted_step_ms=None if plan is None else plan.predicted_step_ms(
                schedule, microbatches=microbatches, dp_replicas=replicas, comm_hook=dp.comm_hook,
                powersgd_rank=dp.powersgd_rank, shard=dp.shard),
            peak_memory_bytes=tuple(rss for rss, _ in peaks), peak_tensor_bytes=tuple(t for _, t in peaks),
            dp=replicas, global_batch_size=samples, comm_hook=dp.comm_hook, powersgd_rank=dp.powersgd_rank,
            shard_optimizer_state=dp.shard_optimizer_state, backward_passes_per_step=dp.backward_passes_per_step,
        )
        if lead:
            path = out or build_dir / "run.json"
            record.to_json(path)
            pred = record.predicted_step_ms
            print(f"median step {record.median_step_ms:.2f} ms"
                  + (f" (plan predicted {pred:.2f} ms)" if pred is not None else "") + f"; wrote {path}", flush=True)
        return record
