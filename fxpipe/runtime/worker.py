"""Entry point of one rank: ``torchrun --nproc-per-node N -m fxpipe.runtime.worker DIR``.

Trains the build directory's model with SGD on the model file's ``example_inputs(B)``
and ``example_targets(B)`` (the same batch every step) and its ``loss_fn``. With
``N = stages x R`` ranks there are R data-parallel replicas of the pipeline: ``B`` is
the batch of ONE replica, and replica r trains on rows ``[r*B, (r+1)*B)`` of
``example_inputs(B*R)`` (so the replicas together see the batch that one process
training on ``B*R`` samples would). Rank 0 prints the loss (averaged over replicas)
and throughput of every step and writes ``DIR/run.json``; after the timed steps it
trains one more (untimed, unreported) accumulation window to measure each rank's peak
tensor memory (``fxpipe.runtime.memory``), written as ``peak_tensor_bytes`` next to the
peak RSS ``peak_memory_bytes``. A user-facing failure prints one
``error: [rank R] Kind: message`` line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.codegen.manifest import Manifest
from fxpipe.errors import FxpipeError, ModelFileError, RuntimeSetupError
from fxpipe.modelfile import load_model_file
from fxpipe.runtime.dataparallel import DataParallelOptions
from fxpipe.runtime.microbatch import check_divisible
from fxpipe.runtime.p2p import peer_error
from fxpipe.runtime.runner import PipelineRunner

__all__ = ["main", "parse_args", "peak_memory_bytes", "predicted_step_ms", "replica_batch", "target_batch_dims"]

ERROR_PREFIX = "error: [rank "


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fxpipe.runtime.worker",
                                description="Train one pipeline stage of a build directory (run under torchrun).")
    p.add_argument("build_dir", type=Path)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    p.add_argument("--microbatches", type=int, default=None, help="default: the plan's microbatch count")
    p.add_argument("--batch-size", type=int, default=None, help="default: the batch size the build was made for")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a silent peer is an error")
    p.add_argument("--device", default=None, help="default: cuda:LOCAL_RANK if available, else cpu")
    p.add_argument("--out", type=Path, default=None, help="default: BUILD_DIR/run.json")
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel replicas; checked against WORLD_SIZE / stages (default: that quotient)")
    p.add_argument("--comm-hook", default="allreduce", help="DDP communication hook (DataParallelOptions)")
    p.add_argument("--powersgd-rank", type=int, default=1)
    p.add_argument("--shard-optimizer-state", action="store_true")
    p.add_argument("--backward-passes-per-step", type=int, default=1)
    return p.parse_args(argv)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: CUDA peak allocated on a GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def predicted_step_ms(build_dir: Path, schedule: str, microbatches: int, dp: int = 1,
                      comm_hook: str = "allreduce", powersgd_rank: int = 1) -> float | None:
    """The plan's predicted step time for ``schedule``, if ``plan.json`` has one for these
    microbatches and was priced for ``dp`` replicas with ``comm_hook`` (and PowerSGD's rank):
    its all-reduce is in it."""
    path = build_dir / "plan.json"
    if not path.is_file():
        return None
    plan = json.loads(path.read_text())
    if plan.get("microbatches") not in (None, microbatches):
        return None
    cost = plan.get("cost", {})
    if cost.get("dp_replicas", 1) != dp or (dp > 1 and cost.get("comm_hook", "allreduce") != comm_hook):
        return None
    if dp > 1 and "powersgd" in comm_hook and cost.get("powersgd_rank", 1) != powersgd_rank:
        return None
    value = plan.get("prediction", {}).get("step_ms", {}).get(schedule)
    return float(value) if value is not None else None


def replica_batch(inputs: tuple[torch.Tensor, ...], targets: Any, batch_dims: Sequence[int | None],
                  replica: int, batch_size: int, target_dims: Sequence[int | None] | None = None,
                  ) -> tuple[tuple[torch.Tensor, ...], Any]:
    """Rows ``[replica*batch_size, (replica+1)*batch_size)`` of a batch made for all replicas.

    Inputs are cut along their batch dim (``None``: shared, passed whole); the leaves of the
    (nested) targets along ``target_dims`` (default: dim 0), as ``split_targets`` does.

    >>> x, y = replica_batch((torch.arange(6).view(6, 1),), torch.arange(6), [0], 1, 2)
    >>> x[0].flatten().tolist(), y.tolist()
    ([2, 3], [2, 3])
    """
    from torch.utils._pytree import tree_flatten, tree_unflatten

    start = replica * batch_size

    def cut(t: Any, dim: int | None) -> Any:
        if dim is None or not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        if t.shape[dim] < start + batch_size:
            raise ModelFileError(f"example data has {t.shape[dim]} rows along dim {dim}, but replica {replica} "
                                 f"needs rows [{start}, {start + batch_size}); example_inputs(n) and "
                                 "example_targets(n) must return n rows")
        return t.narrow(dim, start, batch_size)

    leaves, spec = tree_flatten(targets)
    dims = [0] * len(leaves) if target_dims is None else target_dims
    return (tuple(cut(t, d) for t, d in zip(inputs, batch_dims)),
            tree_unflatten([cut(x, d) for x, d in zip(leaves, dims)], spec))


def target_batch_dims(source: Any, batch_size: int) -> tuple[int | None, ...]:
    """The batch dim of each leaf of the model file's targets, from ``example_targets`` at
    ``batch_size`` and twice that (a leaf that does not grow is shared)."""
    from torch.utils._pytree import tree_leaves

    from fxpipe.tracer.shapes import infer_batch_dims

    first, second = tree_leaves(source.example_targets(batch_size)), tree_leaves(source.example_targets(2 * batch_size))
    tensors = [i for i, x in enumerate(first) if isinstance(x, torch.Tensor)]
    if len(first) != len(second) or any(not isinstance(second[i], torch.Tensor) for i in tensors):
        raise ModelFileError(f"{source.path.name}:{source.targets_fn}(n) returns differently structured targets "
                             f"for n={batch_size} and n={2 * batch_size}")
    try:
        found = infer_batch_dims([first[i] for i in tensors], [second[i] for i in tensors])
    except ValueError as exc:
        raise ModelFileError(f"{source.path.name}:{source.targets_fn}(n): {exc}".replace("input", "target")) from None
    dims: list[int | None] = [None] * len(first)
    for i, d in zip(tensors, found):
        dims[i] = d
    return tuple(dims)


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


def _measure_tensor_peak(runner: PipelineRunner, inputs: tuple[torch.Tensor, ...], targets: Any,
                         steps: int) -> int:
    """Peak tensor bytes of this rank over ``steps`` extra training steps after the timed ones
    (one accumulation window), so the tracker's per-op cost never lands in a timed step."""
    from torch.utils._pytree import tree_leaves

    from fxpipe.runtime.memory import peak_tensor_bytes, state_tensors

    data = [t for t in (*inputs, *tree_leaves(targets)) if isinstance(t, torch.Tensor)]

    def run() -> None:
        for _ in range(steps):
            runner.step(inputs, targets)

    return peak_tensor_bytes(runner.device, run, state_tensors(runner.stage, runner.optimizer) + data)


def _model_source(build_dir: Path, manifest: Manifest) -> Any:
    if not manifest.model_file:
        raise ModelFileError(f"{build_dir}/manifest.json names no model file, so there is no data to train on")
    return load_model_file(manifest.model_path(build_dir), model_fn=manifest.model_fn or None,
                           inputs_fn=manifest.inputs_fn or None)


def _train(args: argparse.Namespace) -> dict[str, Any]:
    manifest = Manifest.from_json(args.build_dir)
    source = _model_source(args.build_dir, manifest)
    batch = args.batch_size or manifest.batch_size
    microbatches = args.microbatches or int(manifest.extra.get("microbatches") or
                                            max(manifest.batch_size // manifest.microbatch_size, 1))
    check_divisible(batch, microbatches)
    if not source.has(source.targets_fn):
        raise ModelFileError(f"{source.path.name} defines no {source.targets_fn}(batch_size); `fxpipe run` needs "
                             "targets to train on")
    world = int(os.environ.get("WORLD_SIZE", manifest.num_stages))
    replicas = args.dp if args.dp is not None else max(world // manifest.num_stages, 1)
    if world != manifest.num_stages * replicas:
        raise RuntimeSetupError(f"--dp {replicas} needs {manifest.num_stages} stages x {replicas} = "
                                f"{manifest.num_stages * replicas} ranks, but WORLD_SIZE is {world}; launch "
                                f"torchrun with --nproc-per-node {manifest.num_stages * replicas} or drop --dp")
    options = DataParallelOptions(comm_hook=args.comm_hook, powersgd_rank=args.powersgd_rank,
                                  shard_optimizer_state=args.shard_optimizer_state,
                                  backward_passes_per_step=args.backward_passes_per_step)
    loss_fn = source.loss_fn
    every_replica = (source.example_inputs(batch * replicas), source.example_targets(batch * replicas))
    target_dims = target_batch_dims(source, batch)
    lr = args.lr
    with PipelineRunner(args.build_dir, loss_fn, schedule=args.schedule, microbatches=microbatches,
                        optimizer_factory=lambda params: torch.optim.SGD(params, lr=lr),
                        device=args.device, timeout_s=args.timeout, data_parallel=options,
                        target_batch_dims=target_dims) as runner:
        inputs, targets = replica_batch(*every_replica, [t.batch_dim for t in manifest.inputs], runner.replica, batch,
                                        target_dims)
        lead = runner.rank == 0
        samples = batch * replicas
        if lead:
            dp_note = (f" x {replicas} replicas (comm hook {options.comm_hook})" if replicas > 1 else "")
            per_replica = " per replica" if replicas > 1 else ""
            print(f"fxpipe run: {manifest.num_stages} stages{dp_note} on {runner.world_size} ranks "
                  f"({runner.device.type}), schedule {args.schedule}, batch {batch}{per_replica} = "
                  f"{microbatches} x {batch // microbatches}", flush=True)
        losses, seconds = [], []
        for k in range(args.steps):
            start = time.perf_counter()
            loss = runner.step(inputs, targets)
            seconds.append(time.perf_counter() - start)
            losses.append(_mean_over_replicas(loss, runner))  # outside the timed step
            if lead:
                print(f"step {k + 1:4d}/{args.steps}  loss {losses[-1]:.6f}  {seconds[-1] * 1e3:8.2f} ms  "
                      f"{samples / seconds[-1]:10.1f} samples/s", flush=True)
        tensor_peak = _measure_tensor_peak(runner, inputs, targets, options.backward_passes_per_step)
        peaks: list[Any] = [None] * runner.world_size
        try:  # over the whole world: one figure per rank, every replica included
            dist.all_gather_object(peaks, (peak_memory_bytes(runner.device), tensor_peak))
        except RuntimeError as exc:
            raise peer_error(exc, runner.rank, "gathering peak memory", args.timeout) from exc
        steady = seconds[1:] or seconds
        result = {
            "losses": losses,
            "step_seconds": seconds,
            "median_step_ms": statistics.median(steady) * 1e3,
            "samples_per_second": samples / statistics.median(steady),
            "schedule": args.schedule,
            "microbatches": microbatches,
            "batch_size": batch,
            "lr": lr,
            "world_size": runner.world_size,
            "num_stages": manifest.num_stages,
            "device": runner.device.type,
            "backend": dist.get_backend(),
            "predicted_step_ms": predicted_step_ms(args.build_dir, args.schedule, microbatches, replicas,
                                                   options.comm_hook, options.powersgd_rank),
            "peak_memory_bytes": [rss for rss, _ in peaks],
            "peak_tensor_bytes": [tensors for _, tensors in peaks],
            "dp": replicas,
            "global_batch_size": samples,
            "comm_hook": options.comm_hook,
            "powersgd_rank": options.powersgd_rank,
            "shard_optimizer_state": options.shard_optimizer_state,
            "backward_passes_per_step": options.backward_passes_per_step,
        }
        if lead:
            out = args.out or args.build_dir / "run.json"
            out.write_text(json.dumps(result, indent=1) + "\n")
            pred = result["predicted_step_ms"]
            print(f"median step {result['median_step_ms']:.2f} ms"
                  + (f" (plan predicted {pred:.2f} ms)" if pred is not None else "") + f"; wrote {out}", flush=True)
        return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        _train(args)
    except FxpipeError as exc:
        rank = os.environ.get("RANK", "?")
        print(f"{ERROR_PREFIX}{rank}] {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
