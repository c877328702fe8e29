"""Sharding benchmark: 2 stages x 2 replicas on gloo (this machine), Adam or SGD, at every sharding level.

Per level (``none``, ``optimizer``, ``grad-op``, ``full``, ``full`` reducing per
microbatch, ``full`` with bf16 parameters) and per rank it measures

* the training state a rank holds between steps: its parameters, gradients and Adam
  state (local shards; exact, from the tensors themselves);
* the peak tensor memory of one step (``PeakSampler``: every tensor storage alive at the
  start plus every one an op creates, summed at every op with its *current* size, so
  FSDP's resizing of its unsharded parameters is seen; activations are kept small, so
  this is mostly parameters + gradients + optimizer state);
* the same peak as ``fxpipe run`` reports it in run.json (``training_peak_tensor_bytes``,
  the runtime's tracker), over the same step;
* the bytes it sends per step on the data-parallel link (``CollectiveCounter``, ring
  convention) against the cost model's prediction (``CostModel.shard_traffic``);
* the median step time (steps 3-12, slowest rank) and the cost model's communication time.

Writes sharding.json and sharding.md next to this file (``--optimizer sgd``: sharding_sgd.json and
sharding_sgd.md, the case without optimizer state to shard).
Run: ``PYTHONPATH=. .venv/bin/python benchmarks/dataparallel/sharding.py [--optimizer sgd]`` (about a minute).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fxpipe.codegen.manifest import Manifest
from fxpipe.partitioner.cost import CostModel
from fxpipe.runtime import PipelineRunner
from fxpipe.runtime.dataparallel import CollectiveCounter, DataParallelOptions
from fxpipe.runtime.launch.launcher import free_port
from fxpipe.runtime.pipeline.peak_memory import training_peak_tensor_bytes

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_common  # noqa: E402

WIDTH, LAYERS, BATCH, MICROBATCHES, STEPS, REPLICAS = 256, 16, 8, 4, 12, 2
OPTIMIZERS = {
    "adam": lambda p: torch.optim.Adam(p, lr=1e-4),
    "sgd": lambda p: torch.optim.SGD(p, lr=1e-4),
}
ONLY = os.environ.get("SHARDING_LEVELS")  # comma-separated subset, for a quick look
LEVELS = {
    "none": DataParallelOptions(),
    "optimizer": DataParallelOptions(shard="optimizer"),
    "grad-op": DataParallelOptions(shard="grad-op"),
    "full": DataParallelOptions(shard="full"),
    "full_microbatch": DataParallelOptions(shard="full", shard_reduce="microbatch"),
    "full_bf16": DataParallelOptions(
        shard="full", shard_param_dtype="bfloat16", shard_reduce_dtype="float32"
    ),
}


if ONLY:
    LEVELS = {k: v for k, v in LEVELS.items() if k in ("none", *ONLY.split(","))}


def _stage(seed: int) -> nn.Module:
    return bench_common.stage(seed, WIDTH, LAYERS)


def _manifest() -> Manifest:
    return bench_common.manifest(WIDTH, LAYERS, BATCH, MICROBATCHES)


class PeakSampler(TorchDispatchMode):
    """Peak over every op of the summed current size of the tensor storages alive (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, weakref.ref] = {}
        self.peak = 0
        with (
            warnings.catch_warnings()
        ):  # isinstance on some objects warns (deprecated torch attributes)
            warnings.simplefilter("ignore")
            for obj in (
                gc.get_objects()
            ):  # everything alive now: state, FSDP's (resized) unsharded buffers, data
                if isinstance(obj, torch.Tensor):
                    self._add(obj)

    def _add(self, t: torch.Tensor) -> None:
        if isinstance(t, DTensor):
            t = t.to_local()
        if t.device.type == "meta" or t.is_sparse:
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        self._storages.setdefault(id(storage), weakref.ref(storage))

    def sample(self) -> None:
        live = 0
        for key, ref in list(self._storages.items()):
            storage = ref()
            if storage is None:
                del self._storages[key]
            else:
                live += storage.nbytes()
        self.peak = max(self.peak, live)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._add(leaf)
        self.sample()
        return out


def _local_bytes(tensors: Any) -> int:
    return sum(
        (t.to_local() if isinstance(t, DTensor) else t).nbytes
        for t in tensors
        if isinstance(t, torch.Tensor)
    )


def _state_bytes(runner: PipelineRunner) -> dict[str, int]:
    opt = runner.optimizer
    inner = opt.optim if hasattr(opt, "optim") else opt  # ZeRO's local optimizer
    return {
        "params": _local_bytes(runner.stage.parameters()),
        "grads": _local_bytes(p.grad for p in runner.stage.parameters()),
        "optimizer": _local_bytes(v for s in inner.state.values() for v in s.values()),
    }


def _worker(rank: int, world: int, port: int, out_dir: str, optimizer: str) -> None:
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
    out: dict[str, Any] = {}
    stage = _stage(
        rank % 2
    )  # the stage's parameter sizes, for the cost model (dropped before anything is measured)
    nbytes = [p.numel() * p.element_size() for p in stage.parameters()]
    shapes = [tuple(p.shape) for p in stage.parameters()]
    del stage
    for name, options in LEVELS.items():
        runner = PipelineRunner(
            _manifest(),
            F.mse_loss,
            stage_loader=lambda i, d: _stage(i),
            microbatches=MICROBATCHES,
            optimizer_factory=OPTIMIZERS[optimizer],
            data_parallel=options,
        )
        seconds = bench_common.timed_steps(runner, (x,), target, STEPS)
        with CollectiveCounter(runner.groups.data_parallel) as counter:
            runner.step((x,), target)
        at_rest = _state_bytes(runner)
        gc.collect()
        with PeakSampler() as sampler:
            runner.step((x,), target)
        gc.collect()
        tracked = training_peak_tensor_bytes(runner, (x,), target, 1)  # what run.json reports
        cost = CostModel(**options.cost_fields(REPLICAS), optimizer=optimizer)
        predicted = cost.shard_traffic(nbytes, shapes, MICROBATCHES)
        out[name] = {
            "median_step_ms": statistics.median(seconds[2:]) * 1e3,
            "at_rest": at_rest,
            "peak_step_bytes": sampler.peak,
            "peak_tracked_bytes": tracked,
            "wire_bytes": counter.wire_bytes,
            "calls": dict(counter.calls),
            "predicted_wire_bytes": predicted.wire_bytes(REPLICAS),
            "predicted_comm_ms": cost.dp_comm_ms(nbytes, shapes, MICROBATCHES),
            "predicted_state_bytes": sum(cost.stage_state_bytes(sum(nbytes))),
            "param_bytes": sum(nbytes),
        }
        del runner
        gc.collect()
    dist.destroy_process_group()
    torch.save(out, f"{out_dir}/rank_{rank}.pt")


def main() -> int:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    optimizer = parser.parse_args().optimizer
    stem = "sharding" if optimizer == "adam" else f"sharding_{optimizer}"
    port, world = free_port(), 2 * REPLICAS
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, port, tmp, optimizer), nprocs=world, join=True)
        results = {r: torch.load(f"{tmp}/rank_{r}.pt", weights_only=True) for r in range(world)}
    rows: dict[str, Any] = {}
    for name in LEVELS:
        per_rank = {r: results[r][name] for r in results}
        none = {r: results[r]["none"] for r in results}
        rest = {r: sum(v["at_rest"].values()) for r, v in per_rank.items()}
        rows[name] = {
            "median_step_ms": max(v["median_step_ms"] for v in per_rank.values()),
            "at_rest_state_bytes": rest,
            "at_rest_ratio": max(rest[r] / sum(none[r]["at_rest"].values()) for r in results),
            "peak_step_bytes": {r: v["peak_step_bytes"] for r, v in per_rank.items()},
            "peak_ratio": max(
                v["peak_step_bytes"] / none[r]["peak_step_bytes"] for r, v in per_rank.items()
            ),
            "peak_tracked_bytes": {r: v["peak_tracked_bytes"] for r, v in per_rank.items()},
            "peak_tracked_ratio": max(
                v["peak_tracked_bytes"] / none[r]["peak_tracked_bytes"] for r, v in per_rank.items()
            ),
            "wire_bytes_rank0": per_rank[0]["wire_bytes"],
            "predicted_wire_bytes_rank0": per_rank[0]["predicted_wire_bytes"],
            "wire_vs_prediction": max(
                v["wire_bytes"] / v["predicted_wire_bytes"] for v in per_rank.values()
            ),
            "wire_vs_prediction_min": min(
                v["wire_bytes"] / v["predicted_wire_bytes"] for v in per_rank.values()
            ),
            "collectives_rank0": per_rank[0]["calls"],
            "collectives": {r: v["calls"] for r, v in per_rank.items()},
            "predicted_comm_ms": per_rank[0]["predicted_comm_ms"],
            "predicted_state_ratio": per_rank[0]["predicted_state_bytes"]
            / none[0]["predicted_state_bytes"],
        }
    data = {
        "setup": {
            "stages": 2,
            "replicas": REPLICAS,
            "backend": "gloo",
            "width": WIDTH,
            "layers_per_stage": LAYERS,
            "batch_per_replica": BATCH,
            "microbatches": MICROBATCHES,
            "steps": STEPS,
            "optimizer": optimizer,
            "schedule": "1f1b",
            "param_bytes_per_stage": results[0]["none"]["param_bytes"],
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
        },
        "levels": rows,
    }
    (HERE / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
    lines = [
        f"# Sharding benchmark (2 stages x 2 replicas, gloo, {optimizer}, 4 microbatches, this machine)",
        "",
        "| level | state at rest / none | predicted / none | peak step memory / none | run.json peak / none "
        "| run.json peak, rank 0 | sent per step (rank 0) | sent / predicted | collectives (rank 0) "
        "| median step ms | predicted dp comm ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        calls = ", ".join(f"{v} {k}" for k, v in sorted(row["collectives_rank0"].items()))
        lines.append(
            f"| {name} | {row['at_rest_ratio']:.3f} | {row['predicted_state_ratio']:.3f} | "
            f"{row['peak_ratio']:.3f} | {row['peak_tracked_ratio']:.3f} | {row['peak_tracked_bytes'][0]} | "
            f"{row['wire_bytes_rank0']:.0f} | "
            f"{row['wire_vs_prediction_min']:.3f}-{row['wire_vs_prediction']:.3f} | {calls} | "
            f"{row['median_step_ms']:.2f} | {row['predicted_comm_ms']:.2f} |"
        )
    (HERE / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
