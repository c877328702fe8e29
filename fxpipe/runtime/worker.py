"""Entry point of one rank: ``torchrun --nproc-per-node N -m fxpipe.runtime.worker DIR``.

Trains the build directory's model with SGD on the model file's ``example_inputs(B)``
and ``example_targets(B)`` (the same batch every step) and its ``loss_fn``. Rank 0
prints the loss and throughput of every step and writes ``DIR/run.json``. A
user-facing failure prints one ``error: [rank R] Kind: message`` line and exits 2.
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
from fxpipe.errors import FxpipeError, ModelFileError
from fxpipe.modelfile import load_model_file
from fxpipe.runtime.microbatch import check_divisible
from fxpipe.runtime.p2p import peer_error
from fxpipe.runtime.runner import PipelineRunner

__all__ = ["main", "parse_args", "peak_memory_bytes", "predicted_step_ms"]

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
    return p.parse_args(argv)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: CUDA peak allocated on a GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def predicted_step_ms(build_dir: Path, schedule: str, microbatches: int) -> float | None:
    """The plan's predicted step time for ``schedule``, if ``plan.json`` has one for these microbatches."""
    path = build_dir / "plan.json"
    if not path.is_file():
        return None
    plan = json.loads(path.read_text())
    if plan.get("microbatches") not in (None, microbatches):
        return None
    value = plan.get("prediction", {}).get("step_ms", {}).get(schedule)
    return float(value) if value is not None else None


def _model_source(build_dir: Path, manifest: Manifest) -> Any:
    path = Path(manifest.model_file)
    if not path.is_absolute() and not path.is_file():
        path = build_dir / path
    if not manifest.model_file:
        raise ModelFileError(f"{build_dir}/manifest.json names no model file, so there is no data to train on")
    return load_model_file(path, model_fn=manifest.model_fn or None, inputs_fn=manifest.inputs_fn or None)


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
    loss_fn = source.loss_fn
    inputs, targets = source.example_inputs(batch), source.example_targets(batch)
    lr = args.lr
    with PipelineRunner(args.build_dir, loss_fn, schedule=args.schedule, microbatches=microbatches,
                        optimizer_factory=lambda params: torch.optim.SGD(params, lr=lr),
                        device=args.device, timeout_s=args.timeout) as runner:
        lead = runner.rank == 0
        if lead:
            print(f"fxpipe run: {manifest.num_stages} stages on {runner.world_size} ranks ({runner.device.type}), "
                  f"schedule {args.schedule}, batch {batch} = {microbatches} x {batch // microbatches}", flush=True)
        losses, seconds = [], []
        for k in range(args.steps):
            start = time.perf_counter()
            loss = runner.step(inputs, targets)
            seconds.append(time.perf_counter() - start)
            losses.append(loss)
            if lead:
                print(f"step {k + 1:4d}/{args.steps}  loss {loss:.6f}  {seconds[-1] * 1e3:8.2f} ms  "
                      f"{batch / seconds[-1]:10.1f} samples/s", flush=True)
        peaks: list[Any] = [None] * runner.world_size
        try:
            dist.all_gather_object(peaks, peak_memory_bytes(runner.device), group=runner.groups.pipeline)
        except RuntimeError as exc:
            raise peer_error(exc, runner.rank, "gathering peak memory", args.timeout) from exc
        steady = seconds[1:] or seconds
        result = {
            "losses": losses,
            "step_seconds": seconds,
            "median_step_ms": statistics.median(steady) * 1e3,
            "samples_per_second": batch / statistics.median(steady),
            "schedule": args.schedule,
            "microbatches": microbatches,
            "batch_size": batch,
            "lr": lr,
            "world_size": runner.world_size,
            "num_stages": manifest.num_stages,
            "device": runner.device.type,
            "backend": dist.get_backend(),
            "predicted_step_ms": predicted_step_ms(args.build_dir, args.schedule, microbatches),
            "peak_memory_bytes": peaks,
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
