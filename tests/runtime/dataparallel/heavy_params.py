"""A 2-stage model whose parameters dominate its peak memory, for the sharded peak test.

Each stage is 4 x ``Linear(192, 192)`` + ``Tanh`` (4 FSDP units of 148 KB under
``shard_wrap="block"``), batch 8 in 4 microbatches: activations of a few KB. Unsharded a
rank holds its parameters P, their gradients P and DDP's bucket P; sharded (``full``) its
half of the parameters, the gradients accumulated whole over the microbatches and a unit or
two at a time.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.codegen.manifest import INPUT, BoundaryTensor, Manifest, StageManifest
from fxpipe.runtime import PipelineRunner
from fxpipe.runtime.dataparallel import DataParallelOptions
from fxpipe.runtime.pipeline.peak_memory import training_peak_tensor_bytes

WIDTH, LAYERS, BATCH, MICROBATCHES = 192, 4, 8, 4
PARAM_BYTES = LAYERS * (WIDTH * WIDTH + WIDTH) * 4  # per stage


def stage(index: int) -> nn.Module:
    torch.manual_seed(index)
    return nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])


def manifest() -> Manifest:
    mb = BATCH // MICROBATCHES
    x = BoundaryTensor("x", (mb, WIDTH), "float32", 0, INPUT, (0,), False)
    h = BoundaryTensor("h", (mb, WIDTH), "float32", 0, 0, (1,), True)
    y = BoundaryTensor("y", (mb, WIDTH), "float32", 0, 1, (), True, 0)
    keys = tuple(k for i in range(LAYERS) for k in (f"{2 * i}.weight", f"{2 * i}.bias"))
    stages = tuple(
        StageManifest(
            i, "Sequential", f"stage_{i}.py", f"stage_{i}.safetensors", "", "", a, b, keys
        )
        for i, (a, b) in enumerate((((x,), (h,)), ((h,), (y,))))
    )
    return Manifest("", "", "", stages, BATCH, mb, (x,))


def measure_peaks(rank: int, levels: dict[str, DataParallelOptions]) -> dict[str, Any]:
    """Per level: two steps' losses (SGD, 1F1B), then one step's peak tensor bytes as run.json
    reports it (``training_peak_tensor_bytes``). Collective over the default group (2 x 2 ranks)."""
    g = torch.Generator().manual_seed(rank // 2)  # each replica its own batch
    x, target = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    out: dict[str, Any] = {}
    for name, options in levels.items():
        runner = PipelineRunner(
            manifest(),
            F.mse_loss,
            stage_loader=lambda i, d: stage(i),
            microbatches=MICROBATCHES,
            schedule="1f1b",
            optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.05),
            data_parallel=options,
        )
        losses = [runner.step((x,), target) for _ in range(2)]
        out[name] = {"losses": losses, "peak": training_peak_tensor_bytes(runner, (x,), target, 1)}
        del runner
    return out
