"""One rank's checkpoint, model-keyed (DCP) against the per-rank files: seconds per GB and peak memory.

    .venv/bin/python benchmarks/runtime/checkpoint/bench_dcp.py [--sizes-mb 64 256] [--repeats 3]

Design (fixed before the run): one process, world size 1 (no collectives), holding a stage of
S MB of fp32 parameters in 8 ``nn.Linear`` layers trained one AdamW step, so the optimizer holds
two moments as large as the parameters: a checkpoint of about 3 x S MB. Each format saves the
same state into a fresh temporary folder, then loads it back into the same module and optimizer:

- ``per-rank``: ``training_state`` + ``save_training_checkpoint`` / ``load_training_checkpoint`` +
  ``restore_training_state`` (``fxpipe.runtime.train.checkpoint``: torch.save, fsync, sha256,
  record, rename);
- ``dcp``: ``save_dcp_checkpoint`` / ``load_dcp_checkpoint``
  (``fxpipe.runtime.train.dcp_checkpoint``: DCP's FileSystemWriter with fsync, per-file sha256,
  record, rename; the load reads in place).

Both run through the same stand-in for a one-rank ``PipelineRunner`` (a real module, AdamW,
LambdaLR). Save and load times are the median of ``--repeats``; seconds per GB count the whole
checkpoint's bytes. Peak memory: each format's first save runs in a fresh child process, which
resets its peak RSS (``VmHWM``, through ``/proc/self/clear_refs``) once the state is built,
and reports the peak over the save minus its RSS just before: what the save itself adds.
(Until 2026-11-28 it read ``ru_maxrss``, which holds the peak of building the state too.) The folder is this machine's temporary disk.
Writes results.json and results.md beside this file.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn as nn

HERE = Path(__file__).resolve().parent
LAYERS = 8


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _runner(megabytes: int) -> Any:
    from fxpipe.runtime.train.optim import optimizer_factory, scheduler_factory
    from fxpipe.runtime.train.training_options import TrainingOptions

    width = int((megabytes * 2**20 / 4 / LAYERS) ** 0.5)
    module = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(LAYERS)))
    options = TrainingOptions(optimizer="adamw", weight_decay=0.1, lr_schedule="cosine")
    optimizer = optimizer_factory(options, 1e-3)(list(module.parameters()))
    scheduler = scheduler_factory(options, 10)(optimizer)
    module(torch.randn(2, width)).sum().backward()
    optimizer.step()
    scheduler.step()
    manifest = SimpleNamespace(
        ties=(), num_stages=1, stage_ranks=(0,), stages=(SimpleNamespace(source_sha256=""),)
    )
    return SimpleNamespace(
        stages={0: module},
        stage=module,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=None,
        rank=0,
        world_size=1,
        replica=0,
        pipeline_rank=0,
        device=torch.device("cpu"),
        manifest=manifest,
        data_parallel=None,
        layout=SimpleNamespace(replicas=1, tensor_parallel=1),
        tp_rank=0,
        schedule=SimpleNamespace(name="1f1b", num_microbatches=1),
        state_dict=module.state_dict,
    )


def _save(fmt: str, runner: Any, folder: str) -> None:
    if fmt == "dcp":
        from fxpipe.runtime.train.dcp_checkpoint import save_dcp_checkpoint

        save_dcp_checkpoint(folder, runner, 1, 8, {"losses": [1.0]}, {"step": 1})
    else:
        from fxpipe.runtime.train.checkpoint import save_training_checkpoint, training_state

        save_training_checkpoint(folder, 0, 1, training_state(runner, 1, 1, {"losses": [1.0]}))


def _load(fmt: str, runner: Any, folder: str) -> None:
    if fmt == "dcp":
        from fxpipe.runtime.train.commit import read_record
        from fxpipe.runtime.train.dcp_checkpoint import load_dcp_checkpoint

        record = read_record(Path(folder) / "checkpoint.json")
        load_dcp_checkpoint(runner, folder, record)
    else:
        from fxpipe.runtime.train.checkpoint import load_training_checkpoint, restore_training_state

        restore_training_state(runner, load_training_checkpoint(folder, 0, 1))


def _child(fmt: str, megabytes: int) -> None:
    """Print the MB a first save adds to this process's peak RSS."""
    import warnings

    warnings.filterwarnings("ignore")
    runner = _runner(megabytes)
    with tempfile.TemporaryDirectory(prefix="fxpipe-ckpt-bench-") as tmp:
        before = _rss_mb()
        _reset_peak()
        _save(fmt, runner, tmp)
        peak = _peak_mb()
    print(json.dumps({"added_mb": peak - before}))


def _reset_peak() -> None:
    """Set the process's peak RSS (VmHWM) to its RSS now: the building of the state (a backward, an
    optimizer step) peaks higher than a save may, and ``ru_maxrss`` cannot be reset."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_mb() -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def measure(fmt: str, megabytes: int, repeats: int) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore")
    runner = _runner(megabytes)
    nbytes = sum(p.numel() * 4 * 3 for p in runner.stage.parameters())
    saves, loads = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="fxpipe-ckpt-bench-") as tmp:
            start = time.perf_counter()
            _save(fmt, runner, tmp)
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            _load(fmt, runner, tmp)
            loads.append(time.perf_counter() - start)
    child = subprocess.run(
        [sys.executable, __file__, "--child", fmt, str(megabytes)],
        capture_output=True,
        text=True,
        check=True,
    )
    added = json.loads(child.stdout.strip().splitlines()[-1])["added_mb"]
    gb = nbytes / 2**30
    save, load = statistics.median(saves), statistics.median(loads)
    return {
        "format": fmt,
        "checkpoint_mb": round(nbytes / 2**20, 1),
        "save_s": round(save, 3),
        "load_s": round(load, 3),
        "save_s_per_gb": round(save / gb, 2),
        "load_s_per_gb": round(load / gb, 2),
        "save_adds_peak_rss_mb": round(added, 1),
        "largest_tensor_mb": round(
            max(p.numel() * 4 for p in runner.stage.parameters()) / 2**20, 1
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=2, default=None)
    args = parser.parse_args()
    if args.child is not None:
        _child(args.child[0], int(args.child[1]))
        return
    rows = [measure(fmt, mb, args.repeats) for mb in args.sizes_mb for fmt in ("per-rank", "dcp")]
    (HERE / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        "| format | checkpoint | save (s) | load (s) | save s/GB | load s/GB | save adds to peak RSS | largest tensor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['format']} | {r['checkpoint_mb']} MB | {r['save_s']} | {r['load_s']} | "
            f"{r['save_s_per_gb']} | {r['load_s_per_gb']} | {r['save_adds_peak_rss_mb']} MB | "
            f"{r['largest_tensor_mb']} MB |"
        )
    (HERE / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
