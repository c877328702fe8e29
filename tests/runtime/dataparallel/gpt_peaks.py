"""``examples/gpt.py`` in 2 stages (2 blocks each), for the sharded peak test: activations are half
a rank's peak and one block 45% of its stage's parameters (Note [units small enough to save]).

``measure_peaks`` trains its build 2 x 2 ranks with SGD, 1F1B and 4 microbatches, as
``fxpipe run --dp 2 --microbatches 4 --optimizer sgd`` does, and reads one step's peak
tensor bytes as run.json reports it (``training_peak_tensor_bytes``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from builds import EXAMPLES, make_build
from fxpipe.modelfile import load_model_file
from fxpipe.runtime import PipelineRunner
from fxpipe.runtime.dataparallel import DataParallelOptions
from fxpipe.runtime.pipeline.peak_memory import training_peak_tensor_bytes

STAGES, BATCH, MICROBATCHES = 2, 8, 4


def build(out_dir: Path) -> Path:
    """The build ``fxpipe partition examples/gpt.py --stages 2 --microbatches 4`` writes."""
    return make_build("gpt", out_dir, STAGES, BATCH, MICROBATCHES)


def measure_peaks(build_dir: Path, levels: dict[str, DataParallelOptions]) -> dict[str, Any]:
    """Per level: two steps' losses, then one step's peak tensor bytes. Collective over the
    default group (2 stages x 2 replicas)."""
    source = load_model_file(EXAMPLES / "gpt.py")
    inputs, targets = source.example_inputs(BATCH), source.example_targets(BATCH)
    out: dict[str, Any] = {}
    for name, options in levels.items():
        runner = PipelineRunner(
            build_dir,
            source.loss_fn,
            schedule="1f1b",
            microbatches=MICROBATCHES,
            optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.01),
            data_parallel=options,
        )
        losses = [runner.step(inputs, targets) for _ in range(2)]
        peak = training_peak_tensor_bytes(runner, inputs, targets, 1)
        out[name] = {"losses": losses, "peak": peak, "stage": sorted(runner.stages)}
        runner.close()
    return out
