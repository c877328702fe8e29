"""Per-unit costs: FLOPs, saved activations, and analytic or measured times.

Each unit runs on its own, with the values it received in the shape-propagation run
as (detached) inputs: forward under ``FlopCounterMode`` and
``saved_tensors_hooks`` (activation bytes = storages autograd saves for backward,
deduplicated, parameters and buffers excluded), then backward under ``FlopCounterMode``.

Analytic times come from a roofline: ``max(flops / peak, bytes / bandwidth)`` plus a
per-op overhead, with one :class:`DevicePreset` per trace device; backward reads
roughly twice the forward's bytes. Measured times are medians over repeats after
warm-up (CUDA synchronized).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.fx
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from fxpipe.tracer.units import UnitGroup

__all__ = ["DevicePreset", "DEVICE_PRESETS", "UnitRunner", "UnitCounts", "count_unit", "analytic_ms", "measure_ms",
           "measure_memory_bytes", "progress_iter"]


@dataclass(frozen=True)
class DevicePreset:
    """Roofline parameters of a device class (fp32)."""

    name: str
    flops_per_s: float
    bytes_per_s: float
    op_overhead_s: float


DEVICE_PRESETS: dict[str, DevicePreset] = {
    "cpu": DevicePreset("cpu", flops_per_s=50e9, bytes_per_s=10e9, op_overhead_s=5e-6),
    "cuda": DevicePreset("cuda", flops_per_s=19.5e12, bytes_per_s=1.5e12, op_overhead_s=5e-6),
}


@dataclass(frozen=True)
class UnitCounts:
    """What one forward/backward of a unit does, independent of timing."""

    fwd_flops: float
    bwd_flops: float
    fwd_bytes: int  # inputs + outputs + parameters and buffers read
    activation_bytes: int
    n_ops: int
    has_backward: bool


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


class UnitRunner:
    """Runs one unit's nodes on its recorded inputs; ``forward()`` returns (outputs, grad leaves)."""

    def __init__(self, gm: torch.fx.GraphModule, group: UnitGroup, values: dict[torch.fx.Node, Any]) -> None:
        by_name = {n.name: n for n in gm.graph.nodes}
        self.gm = gm
        self.group = group
        self.attr_nodes = [by_name[a] for a in group.get_attrs]
        self.nodes = [by_name[n] for n in group.nodes]
        self.output_nodes = [by_name[n] for n in group.outputs]
        self.input_values = {by_name[n]: values[by_name[n]] for n in group.inputs}
        self.tensors = self._tensors()

    def _tensors(self) -> list[torch.Tensor]:
        """Parameters and buffers the unit reads (from get_attr nodes and leaf modules)."""
        found: dict[int, torch.Tensor] = {}
        for node in self.attr_nodes:
            value = _fetch(self.gm, str(node.target))
            if isinstance(value, torch.Tensor):
                found[id(value)] = value
        for node in self.nodes:
            if node.op == "call_module":
                module = self.gm.get_submodule(str(node.target))
                for t in list(module.parameters()) + list(module.buffers()):
                    found[id(t)] = t
        return list(found.values())

    @property
    def params(self) -> list[torch.Tensor]:
        return [t for t in self.tensors if isinstance(t, nn.Parameter) and t.requires_grad]

    def forward(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        interp = torch.fx.Interpreter(self.gm, garbage_collect_values=False)
        leaves = []
        for node, value in self.input_values.items():
            if isinstance(value, torch.Tensor):
                value = value.detach().requires_grad_(value.requires_grad and value.is_floating_point())
                if value.requires_grad:
                    leaves.append(value)
            interp.env[node] = value
        for node in self.attr_nodes + self.nodes:
            interp.env[node] = interp.run_node(node)
        outputs = [interp.env[n] for n in self.output_nodes]
        return outputs, leaves + self.params

    @staticmethod
    def backward(outputs: list[Any], leaves: list[torch.Tensor]) -> bool:
        """Backpropagate ones from the differentiable outputs; False when there is nothing to do."""
        outs = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
        if not outs or not leaves:
            return False
        torch.autograd.grad(outs, leaves, grad_outputs=[torch.ones_like(o) for o in outs], allow_unused=True)
        return True


def _fetch(gm: torch.fx.GraphModule, target: str) -> Any:
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


def count_unit(runner: UnitRunner) -> UnitCounts:
    """Run the unit forward and backward once, counting FLOPs and saved activation bytes."""
    state_ptrs = {t.untyped_storage().data_ptr() for t in runner.tensors}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in state_ptrs:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    fwd, bwd = FlopCounterMode(display=False), FlopCounterMode(display=False)
    with fwd, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outputs, leaves = runner.forward()
    with bwd:
        has_backward = runner.backward(outputs, leaves)
    io_bytes = sum(_nbytes(v) for v in runner.input_values.values()) + sum(_nbytes(o) for o in outputs)
    return UnitCounts(
        fwd_flops=float(fwd.get_total_flops()),
        bwd_flops=float(bwd.get_total_flops()),
        fwd_bytes=io_bytes + sum(_nbytes(t) for t in runner.tensors),
        activation_bytes=sum(saved.values()),
        n_ops=len(runner.nodes),
        has_backward=has_backward,
    )


def analytic_ms(counts: UnitCounts, preset: DevicePreset) -> tuple[float, float]:
    """Roofline forward and backward milliseconds of one unit."""
    fwd = max(counts.fwd_flops / preset.flops_per_s, counts.fwd_bytes / preset.bytes_per_s)
    fwd += counts.n_ops * preset.op_overhead_s
    if not counts.has_backward:
        return fwd * 1e3, 0.0
    bwd = max(counts.bwd_flops / preset.flops_per_s, 2 * counts.fwd_bytes / preset.bytes_per_s)
    bwd += 2 * counts.n_ops * preset.op_overhead_s
    return fwd * 1e3, bwd * 1e3


def measure_ms(runner: UnitRunner, device: str, warmup: int = 2, repeats: int = 5) -> tuple[float, float]:
    """Median forward and backward milliseconds of one unit over ``repeats`` runs after ``warmup``."""
    sync: Callable[[], None] = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fwd_times, bwd_times = [], []
    for i in range(warmup + repeats):
        sync()
        t0 = time.perf_counter()
        outputs, leaves = runner.forward()
        sync()
        t1 = time.perf_counter()
        has_backward = runner.backward(outputs, leaves)
        sync()
        t2 = time.perf_counter()
        if i >= warmup:
            fwd_times.append(t1 - t0)
            bwd_times.append(t2 - t1 if has_backward else 0.0)
    return statistics.median(fwd_times) * 1e3, statistics.median(bwd_times) * 1e3


def measure_memory_bytes(runner: UnitRunner) -> int:
    """Device memory (CUDA allocator) that one forward keeps alive for backward, outputs included."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    outputs, leaves = runner.forward()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    del outputs, leaves
    return max(held, 0)


def progress_iter(items: Iterable[Any], description: str, enabled: bool, total: int) -> Iterable[Any]:
    """``items`` with a rich progress bar when ``enabled``."""
    if not enabled:
        yield from items
        return
    from rich.progress import Progress

    with Progress(transient=True) as progress:
        task = progress.add_task(description, total=total)
        for item in items:
            yield item
            progress.advance(task)
