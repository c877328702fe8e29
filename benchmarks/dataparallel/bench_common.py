"""What the data-parallel benchmarks share: the hand-split model (2 stages, each ``layers`` x
``Linear(width, width)`` + ``Tanh``) and the timed step loop."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fxpipe.codegen.manifest import INPUT, BoundaryTensor, Manifest, StageManifest


def stage(seed: int, width: int, layers: int) -> nn.Module:
    """Stage ``seed``'s module (every replica builds the same one from the seed)."""
    torch.manual_seed(seed)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())])


def manifest(width: int, layers: int, batch: int, microbatches: int) -> Manifest:
    """The 2-stage manifest: input ``x`` into stage 0, ``h`` to stage 1, model output ``y``."""
    mb = batch // microbatches
    x = BoundaryTensor("x", (mb, width), "float32", 0, INPUT, (0,), False)
    h = BoundaryTensor("h", (mb, width), "float32", 0, 0, (1,), True)
    y = BoundaryTensor("y", (mb, width), "float32", 0, 1, (), True, 0)
    keys = tuple(k for i in range(layers) for k in (f"{2 * i}.weight", f"{2 * i}.bias"))
    stages = tuple(
        StageManifest(
            i, "Sequential", f"stage_{i}.py", f"stage_{i}.safetensors", "", "", ins, outs, keys
        )
        for i, (ins, outs) in enumerate((((x,), (h,)), ((h,), (y,))))
    )
    return Manifest(
        model_file="",
        model_fn="",
        model_sha256="",
        stages=stages,
        batch_size=batch,
        microbatch_size=mb,
        inputs=(x,),
    )


def timed_steps(
    runner: Any, inputs: tuple[torch.Tensor, ...], target: torch.Tensor, steps: int
) -> list[float]:
    """Seconds of each of ``steps`` training steps, every rank starting each one together."""
    seconds = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        runner.step(inputs, target)
        seconds.append(time.perf_counter() - start)
    return seconds
