"""The cost of the data path: step time with the model file's ``train_batches`` vs one fixed batch.

    .venv/bin/python benchmarks/runtime/bench_data.py [--steps 30] [--out benchmarks/runtime]

Builds ``examples/charlm.py`` (a character LM whose ``train_batches`` cuts random windows
of README.md) into 2 stages, batch 16 in 4 microbatches, then under torchrun (2 ranks,
gloo, CPU, one thread each) runs one ``PipelineRunner`` two ways, alternating step by
step (which one goes first alternates too): **data** draws each step's batch from
``fxpipe.runtime.train.data_iter.batch_stream`` over ``train_batches`` (as ``fxpipe run``
does: each rank reads only what it needs) and steps on it; **fixed** steps on one batch
drawn once before timing. Each timed step (the draw included) sits between two
``dist.barrier()`` calls, so both pay the same barrier and see the same machine load.
Reported: the median step time of each and their ratio ``data / fixed`` (1.0: the
data path costs nothing). Writes data.json and data.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
MODEL, BATCH, MICROBATCHES, WARMUP = ROOT / "examples" / "charlm.py", 16, 4, 3


def _build(out: Path) -> None:
    from fxpipe.codegen import write_build_dir
    from fxpipe.modelfile import load_model_file
    from fxpipe.partitioner import plan_partition
    from fxpipe.tracer import trace_model_file

    torch.set_num_threads(1)
    source = load_model_file(MODEL)
    traced = trace_model_file(source, BATCH // MICROBATCHES)
    plan = plan_partition(traced.profile, 2, microbatches=MICROBATCHES)
    write_build_dir(traced, plan, out, source, batch_size=BATCH, microbatches=MICROBATCHES)


def _worker(build_dir: Path, steps: int) -> None:
    """Run under torchrun: the same runner on streamed and on fixed batches, alternating."""
    import torch.distributed as dist

    from fxpipe.codegen.manifest import Manifest
    from fxpipe.runtime import PipelineRunner
    from fxpipe.runtime.train.data import model_source
    from fxpipe.runtime.train.data_iter import TRAIN_FN, batch_stream, find_batches
    from fxpipe.runtime.train.loop import rank_info

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    source = model_source(build_dir, Manifest.from_json(build_dir))
    runner = PipelineRunner(
        build_dir,
        source.loss_fn,
        microbatches=MICROBATCHES,
        optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.01),
        # as fxpipe run's loop: a rank that needs no inputs is given None for them, which the
        # runner's own batch check would call a different batch (the loop checks the stream)
        check_batches=False,
    )
    train_fn = find_batches(source, None, TRAIN_FN)
    assert train_fn is not None, f"{MODEL} has no {TRAIN_FN}"
    stream = batch_stream(train_fn, runner.manifest, BATCH, rank_info(runner))
    fixed = next(stream)
    times: dict[str, list[float]] = {"data": [], "fixed": []}
    for k in range(WARMUP + steps):
        for mode in ("data", "fixed") if k % 2 == 0 else ("fixed", "data"):
            dist.barrier()
            start = time.perf_counter()
            runner.step(*(next(stream) if mode == "data" else fixed))
            dist.barrier()
            if k >= WARMUP:
                times[mode].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        (build_dir / "data_path.json").write_text(json.dumps(times))
    runner.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="timed steps of each kind")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    p.add_argument("--build", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.build is not None:
        return _build(args.build)
    if args.worker is not None:
        return _worker(args.worker, args.steps)
    from launch_ranks import torchrun

    with tempfile.TemporaryDirectory(prefix="fxpipe-data-bench-") as tmp:
        build_dir = Path(tmp) / "charlm"
        subprocess.run([sys.executable, __file__, "--build", str(build_dir)], check=True)
        subprocess.run(
            torchrun(__file__, 2, str(build_dir), "--steps", str(args.steps)),
            check=True,
            stderr=subprocess.DEVNULL,
        )
        times = json.loads((build_dir / "data_path.json").read_text())
    data, fixed = (statistics.median(times[m]) * 1e3 for m in ("data", "fixed"))
    row = {
        "model": "charlm (examples/charlm.py)",
        "ranks": 2,
        "batch_size": BATCH,
        "microbatches": MICROBATCHES,
        "steps": args.steps,
        "data_step_ms": data,
        "fixed_step_ms": fixed,
        "data_over_fixed": data / fixed,
    }
    (args.out / "data.json").write_text(json.dumps(row, indent=1) + "\n")
    lines = [
        "| model | batch | train_batches step (ms) | fixed batch step (ms) | data / fixed |",
        "|---|---|---|---|---|",
        f"| {row['model']} | {BATCH} = {MICROBATCHES} x {BATCH // MICROBATCHES} | {data:.2f} | {fixed:.2f} | "
        f"{data / fixed:.3f} |",
    ]
    (args.out / "data.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
