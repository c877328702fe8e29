"""Data-parallel benchmark: 2 stages x 2 replicas on gloo (this machine), one process per rank.

Measures, per communication hook (allreduce, fp16, PowerSGD rank 1/2/4), the median
step time and the gradient bytes each rank puts into the all-reduce per step, and the
per-rank Adam state with and without ZeRO sharding. Writes results.json and results.md
next to this file. Run: ``.venv/bin/python benchmarks/dataparallel/run.py``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.codegen.manifest import Manifest
from fxpipe.runtime import PipelineRunner
from fxpipe.runtime.dataparallel import DataParallelOptions, optimizer_state_bytes
from fxpipe.runtime.launch.launcher import free_port

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_common  # noqa: E402

WIDTH, LAYERS, BATCH, MICROBATCHES, STEPS = 512, 4, 32, 2, 12
HOOKS = {
    "allreduce": {},
    "fp16": {},
    "powersgd_r1": {"powersgd_rank": 1},
    "powersgd_r2": {"powersgd_rank": 2},
    "powersgd_r4": {"powersgd_rank": 4},
}


def _stage(seed: int) -> nn.Module:
    return bench_common.stage(seed, WIDTH, LAYERS)


def _manifest() -> Manifest:
    return bench_common.manifest(WIDTH, LAYERS, BATCH, MICROBATCHES)


def _payload_bytes(runner: PipelineRunner, hook: str) -> float:
    """Gradient bytes this rank hands to the all-reduce per step (before the ring's 2(R-1)/R)."""
    numel = sum(p.numel() for p in runner.stage.parameters())
    if hook == "fp16":
        return numel * 2.0
    state = runner.data_parallel.hook_state if runner.data_parallel is not None else None
    if state is not None and hasattr(state, "total_numel_after_compression"):
        return (
            state.total_numel_after_compression
            * 4.0
            / max(state.iter - state.start_powerSGD_iter, 1)
        )
    return numel * 4.0


def _worker(rank: int, world: int, port: int, queue: mp.Queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(rank // 2)
    x, target = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    out: dict = {"hooks": {}, "zero": {}}
    for name, extra in HOOKS.items():
        hook = "powersgd" if name.startswith("powersgd") else name
        options = DataParallelOptions(comm_hook=hook, powersgd_start_iter=2, **extra)
        runner = PipelineRunner(
            _manifest(),
            F.mse_loss,
            stage_loader=lambda i, d: _stage(i),
            microbatches=MICROBATCHES,
            optimizer_factory=lambda p: torch.optim.SGD(p, lr=1e-3),
            data_parallel=options,
        )
        seconds = bench_common.timed_steps(runner, (x,), target, STEPS)
        out["hooks"][name] = {
            "median_step_ms": statistics.median(seconds[3:]) * 1e3,
            "payload_bytes": _payload_bytes(runner, hook),
        }
    for shard in (False, True):
        runner = PipelineRunner(
            _manifest(),
            F.mse_loss,
            stage_loader=lambda i, d: _stage(i),
            microbatches=MICROBATCHES,
            optimizer_factory=lambda p: torch.optim.Adam(p, lr=1e-3),
            data_parallel=DataParallelOptions(shard_optimizer_state=shard),
        )
        runner.step((x,), target)
        out["zero"]["sharded" if shard else "unsharded"] = optimizer_state_bytes(runner.optimizer)
    dist.destroy_process_group()
    queue.put((rank, out))


def main() -> int:
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 4, port, queue)) for r in range(4)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    base = results[0]["hooks"]["allreduce"]
    rows = {
        name: {
            "median_step_ms": max(results[r]["hooks"][name]["median_step_ms"] for r in results),
            "payload_bytes_rank0": results[0]["hooks"][name]["payload_bytes"],
            "bytes_ratio": results[0]["hooks"][name]["payload_bytes"] / base["payload_bytes"],
            "time_ratio": max(results[r]["hooks"][name]["median_step_ms"] for r in results)
            / max(results[r]["hooks"]["allreduce"]["median_step_ms"] for r in results),
        }
        for name in HOOKS
    }
    zero = {r: results[r]["zero"] for r in sorted(results)}
    data = {
        "setup": {
            "stages": 2,
            "replicas": 2,
            "backend": "gloo",
            "width": WIDTH,
            "layers_per_stage": LAYERS,
            "batch_per_replica": BATCH,
            "microbatches": MICROBATCHES,
            "steps": STEPS,
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
        },
        "hooks": rows,
        "optimizer_state_bytes": zero,
        "zero_ratio_per_rank": {r: z["sharded"] / z["unsharded"] for r, z in zero.items()},
    }
    (HERE / "results.json").write_text(json.dumps(data, indent=1) + "\n")
    lines = [
        "# Data-parallel benchmark (2 stages x 2 replicas, gloo, this machine)",
        "",
        "| hook | median step ms (slowest rank) | step time / allreduce | gradient bytes per step (rank 0) "
        "| bytes / allreduce |",
        "|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['median_step_ms']:.2f} | {row['time_ratio']:.2f} | "
            f"{row['payload_bytes_rank0']:.0f} | {row['bytes_ratio']:.4f} |"
        )
    lines += ["", "| rank | Adam state bytes unsharded | with ZeRO | ratio |", "|---|---|---|---|"]
    for r, z in zero.items():
        lines.append(
            f"| {r} | {z['unsharded']} | {z['sharded']} | {z['sharded'] / z['unsharded']:.2f} |"
        )
    (HERE / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
