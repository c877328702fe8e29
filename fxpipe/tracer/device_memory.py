"""Activation memory from the CUDA allocator (``--measure-memory``)."""

from __future__ import annotations

import torch

from fxpipe.tracer.unit_runner import UnitRunner

__all__ = ["measure_memory_bytes"]


def measure_memory_bytes(runner: UnitRunner) -> int:
    """Device memory (CUDA allocator) that one forward keeps alive for backward, outputs included."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    outputs, leaves = runner.forward()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    del outputs, leaves
    return max(held, 0)
