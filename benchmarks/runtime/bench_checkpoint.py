"""The cost of one rank's training checkpoint: seconds per GB to save (commit included) and to load.

    .venv/bin/python benchmarks/runtime/bench_checkpoint.py [--sizes-mb 16 64 256] [--out benchmarks/runtime]

One process (world size 1: the all-gather of the commit is skipped) saves a part of
S MB of fp32 tensors (a stage's parameters plus Adam's two moments, in 3 equal thirds)
with ``fxpipe.runtime.train.checkpoint.save_training_checkpoint`` (torch.save into a
hidden file, fsync, sha256, record, rename) into a temporary folder, then loads it back
(sha256 check, ``torch.load(weights_only=True)``). The median of 3 runs per size is
reported. The folder is on this machine's temporary disk; a network filesystem differs.
Writes checkpoint.json and checkpoint.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fxpipe.runtime.train.checkpoint import load_training_checkpoint, save_training_checkpoint


def _state(megabytes: int) -> dict:
    n = megabytes * (1 << 20) // 4 // 3
    model = {"w": torch.randn(n)}
    optimizer = {
        "state": {
            0: {"exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n), "step": torch.tensor(3.0)}
        },
        "param_groups": [{"lr": 1e-3, "params": [0]}],
    }
    return {
        "step": 3,
        "data_position": 3,
        "model": model,
        "optimizer": optimizer,
        "history": {"losses": [1.0]},
    }


def measure(megabytes: int, repeats: int = 3) -> dict:
    state = _state(megabytes)
    saves, loads = [], []
    with tempfile.TemporaryDirectory(prefix="fxpipe-ckpt-bench-") as tmp:
        for _ in range(repeats):
            start = time.perf_counter()
            save_training_checkpoint(tmp, 0, 1, state)
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            load_training_checkpoint(tmp, 0, 1)
            loads.append(time.perf_counter() - start)
    gb = megabytes / 1024
    save, load = statistics.median(saves), statistics.median(loads)
    return {
        "megabytes": megabytes,
        "save_s": save,
        "load_s": load,
        "save_s_per_gb": save / gb,
        "load_s_per_gb": load / gb,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = p.parse_args()
    rows = [measure(s) for s in args.sizes_mb]
    (args.out / "checkpoint.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["| part size | save (s) | load (s) | save s/GB | load s/GB |", "|---|---|---|---|---|"]
    lines += [
        f"| {r['megabytes']} MB | {r['save_s']:.3f} | {r['load_s']:.3f} | {r['save_s_per_gb']:.2f} | "
        f"{r['load_s_per_gb']:.2f} |"
        for r in rows
    ]
    (args.out / "checkpoint.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
