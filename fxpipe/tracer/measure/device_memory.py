"""Activation memory from the CUDA allocator (``--measure-memory``)."""

from __future__ import annotations

import torch

from fxpipe.tracer.measure.unit_runner import UnitRunner

__all__ = ["measure_memory_bytes"]


def measure_memory_bytes(runner: UnitRunner) -> int:
    """Device memory (CUDA allocator) that one forward keeps alive for backward, outputs included.

    A first, unmeasured forward lets the libraries allocate what they keep for good (cuBLAS's
    workspaces, which the prediction counts once per rank, ``RuntimeCosts.workspace_bytes``).
    """
    runner.run(runner.fresh_inputs())  # outputs dropped at once
    inputs = runner.fresh_inputs()  # allocated before the measurement, as a real stage's inputs are
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    outputs = runner.run(inputs)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    del outputs, inputs
    return max(held, 0)
