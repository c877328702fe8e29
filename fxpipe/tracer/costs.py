"""Per-unit costs: FLOPs, saved activations, and analytic or measured times.

Each unit runs on its own, with the values it received in the shape-propagation run
as (detached) inputs: forward under ``FlopCounterMode`` and
``saved_tensors_hooks`` (activation bytes = storages autograd saves for backward,
deduplicated, parameters and buffers excluded), then backward under ``FlopCounterMode``.

Note [analytic unit time]: ``max(flops / peak, bytes / bandwidth)`` plus a fixed cost
per dispatched aten op (forward and backward counted separately while the unit runs
under a dispatch mode, with an extra cost for op kinds that are slow at small sizes,
such as convolutions), with one :class:`DevicePreset` per trace device. Backward reads
roughly twice the forward's bytes and also pays one gradient accumulation per
parameter (microbatches after the first add into ``.grad``). On small models the op
costs dominate: a 4-layer width-32 GPT block runs ~110 aten ops per forward for only
~2 MFLOP, which is why a flops-only roofline predicted a third of the real step.

Measured times run each unit's nodes as ONE compiled ``GraphModule`` call (not node by
node through an ``Interpreter``, whose per-node Python cost inflated tiny units
several-fold) and take medians over repeats after warm-up (CUDA synchronized). On CPU
they are timed with one intra-op thread, as each ``torchrun`` worker runs
(``OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.fx
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from fxpipe.tracer.units import UnitGroup

__all__ = ["DevicePreset", "DEVICE_PRESETS", "UnitRunner", "UnitCounts", "OpCounter", "count_unit", "analytic_ms",
           "op_overhead_s", "measure_ms", "measure_memory_bytes", "progress_iter", "ACCUMULATE_OP"]

ACCUMULATE_OP = "accumulate_grad"  # pseudo-op: one gradient accumulation per parameter in backward


@dataclass(frozen=True)
class DevicePreset:
    """Roofline parameters of a device class (fp32), Note [analytic unit time].

    ``op_overhead_s`` is the fixed cost of one forward aten op in a warm loop,
    ``bwd_op_overhead_s`` that of one backward op (``None``: the same); ``op_extra_s``
    adds, per op name (the aten overload packet, e.g. ``"convolution_backward"``), a cost
    on top. ``cold_factor`` scales these fixed costs to what they are inside a running
    pipeline, where each action starts with cold caches after waiting on its peers.
    """

    name: str
    flops_per_s: float
    bytes_per_s: float
    op_overhead_s: float
    bwd_op_overhead_s: float | None = None
    op_extra_s: tuple[tuple[str, float], ...] = ()
    cold_factor: float = 1.0

    def op_cost_s(self, op: str, backward: bool) -> float:
        """Seconds of fixed cost for one call of aten op ``op`` in a warm loop."""
        base = self.bwd_op_overhead_s if backward and self.bwd_op_overhead_s is not None else self.op_overhead_s
        return base + dict(self.op_extra_s).get(op, 0.0)


# "cpu": calibrated on this project's 2-core machine with one intra-op thread (as torchrun
# workers run), torch 2.13 eager. A 512^3 fp32 matmul sustains ~88 GFLOP/s and the 128-wide
# GPT of benchmarks/runtime ~70-77 GFLOP/s end to end; a 16 MB add ~50 GB/s (set lower: a
# unit's bytes also miss in cache). Per-op costs in a warm single-process loop are the
# slope of eager time over dispatched aten ops (GPT width 32: 3.1 us forward, 2.9 backward;
# MLP 3.4 / 1.7; chains of tiny relu / mul-add: 1.5-2.2 / 2.6-3.2); torch.profiler on
# examples/resnet.py (8-32 channels, 16x16) put a small mkldnn convolution at ~52 us forward
# and ~110 us backward, batch norm at ~15 us. Timers around the stage module inside a
# running 2-rank pipeline measured ~1.45x the warm-loop time on the GPT and the ResNet
# (cold_factor). Scratch scripts and numbers: benchmarks/prediction/README.md.
DEVICE_PRESETS: dict[str, DevicePreset] = {
    "cpu": DevicePreset("cpu", flops_per_s=75e9, bytes_per_s=20e9, op_overhead_s=3.0e-6, bwd_op_overhead_s=2.8e-6,
                        op_extra_s=(("convolution", 40e-6), ("convolution_backward", 90e-6),
                                    ("native_batch_norm", 10e-6), ("native_batch_norm_backward", 3e-6)),
                        cold_factor=1.45),
    "cuda": DevicePreset("cuda", flops_per_s=19.5e12, bytes_per_s=1.5e12, op_overhead_s=5e-6),
}


@dataclass(frozen=True)
class UnitCounts:
    """What one forward/backward of a unit does, independent of timing."""

    fwd_flops: float
    bwd_flops: float
    fwd_bytes: int  # inputs + outputs + parameters and buffers read
    activation_bytes: int
    n_ops: int  # FX nodes of the unit
    has_backward: bool
    fwd_ops: tuple[tuple[str, int], ...] = ()  # dispatched aten ops (name, calls); empty: use n_ops
    bwd_ops: tuple[tuple[str, int], ...] = ()


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it, by overload packet name (``"addmm"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def items(self) -> tuple[tuple[str, int], ...]:
        return tuple(sorted(self.counts.items()))


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
        self._values = values  # every node's recorded value, to rerun an input's producer (Note [saved once])

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

    @functools.cached_property
    def module(self) -> torch.fx.GraphModule:
        """The unit's nodes as one GraphModule: inputs in ``input_values`` order, a tuple of outputs."""
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in self.input_values:
            env[node] = graph.placeholder(node.name)
        for node in self.attr_nodes + self.nodes:
            env[node] = graph.node_copy(node, lambda n: env[n])
        graph.output(tuple(env[n] for n in self.output_nodes))
        return torch.fx.GraphModule(self.gm, graph)

    def fresh_inputs(self) -> tuple[list[Any], list[torch.Tensor]]:
        """Detached copies of the recorded inputs (floating ones require grad), and the grad leaves."""
        leaves, args = [], []
        for value in self.input_values.values():
            if isinstance(value, torch.Tensor):
                value = value.detach().requires_grad_(value.requires_grad and value.is_floating_point())
                if value.requires_grad:
                    leaves.append(value)
            args.append(value)
        return args, leaves + self.params

    def forward(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        args, leaves = self.fresh_inputs()
        return list(self.module(*args)), leaves

    @staticmethod
    def backward(outputs: list[Any], leaves: list[torch.Tensor],
                 grad_outputs: list[torch.Tensor] | None = None) -> bool:
        """Backpropagate ``grad_outputs`` (default ones) from the differentiable outputs;
        False when there is nothing to do."""
        outs = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
        if not outs or not leaves:
            return False
        grads = grad_outputs if grad_outputs is not None else [torch.ones_like(o) for o in outs]
        torch.autograd.grad(outs, leaves, grad_outputs=grads, allow_unused=True)
        return True


def _fetch(gm: torch.fx.GraphModule, target: str) -> Any:
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


def _saved_storages(fn: Callable[[], Any], exclude: Iterable[int] = ()) -> tuple[Any, dict[int, int]]:
    """``fn()`` and the storages (data pointer -> bytes) autograd saves for backward while it runs."""
    saved: dict[int, int] = {}
    skip = set(exclude)

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def _producer_saves_output(runner: UnitRunner, node: torch.fx.Node) -> bool:
    """Whether the node that made input ``node`` saves its own output for backward
    (run alone on its recorded inputs; Note [saved once])."""
    if node.op not in ("call_module", "call_function", "call_method"):
        return False
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    args: list[Any] = []
    for i, arg in enumerate(node.all_input_nodes):
        env[arg] = graph.placeholder(f"in_{i}")
        value = runner._values.get(arg)
        if isinstance(value, torch.Tensor):
            value = value.detach().requires_grad_(value.is_floating_point())
        args.append(value)
    graph.output(graph.node_copy(node, lambda n: env[n]))
    try:
        out, saved = _saved_storages(lambda: torch.fx.GraphModule(runner.gm, graph)(*args))
    except Exception:  # an op that cannot run alone: charge the input to the consumer as before
        return False
    return isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() in saved


def count_unit(runner: UnitRunner) -> UnitCounts:
    """Run the unit forward and backward once, counting FLOPs and saved activation bytes.

    Note [saved once]: activation bytes are the storages autograd saves, each charged to
    ONE unit: a saved input of the unit is charged to the unit that made it when that
    unit's last op saves it too (ReLU saves its output, and the Linear after it saves
    the same tensor as its input), else to this unit. Charging both doubled the
    activations of every Linear/ReLU chain (measured in tests/runtime/test_memory.py).
    """
    state_ptrs = {t.untyped_storage().data_ptr() for t in runner.tensors}
    input_ptrs = {v.untyped_storage().data_ptr(): node for node, v in runner.input_values.items()
                  if isinstance(v, torch.Tensor)}

    fwd, bwd = FlopCounterMode(display=False), FlopCounterMode(display=False)
    with fwd:
        (outputs, leaves), saved = _saved_storages(runner.forward, state_ptrs)
    for ptr in set(saved) & set(input_ptrs):
        if _producer_saves_output(runner, input_ptrs[ptr]):
            del saved[ptr]
    with bwd:
        has_backward = runner.backward(outputs, leaves)
    fwd_ops, bwd_ops = _count_ops(runner)
    io_bytes = sum(_nbytes(v) for v in runner.input_values.values()) + sum(_nbytes(o) for o in outputs)
    return UnitCounts(
        fwd_flops=float(fwd.get_total_flops()),
        bwd_flops=float(bwd.get_total_flops()),
        fwd_bytes=io_bytes + sum(_nbytes(t) for t in runner.tensors),
        activation_bytes=sum(saved.values()),
        n_ops=len(runner.nodes),
        has_backward=has_backward,
        fwd_ops=fwd_ops.items(),
        bwd_ops=bwd_ops.items(),
    )


def op_overhead_s(ops: Iterable[tuple[str, int]], preset: DevicePreset, backward: bool) -> float:
    """Fixed seconds of the ops ``(name, calls)`` on ``preset`` inside a running pipeline
    (warm-loop cost x ``cold_factor``, Note [analytic unit time])."""
    return preset.cold_factor * sum(calls * preset.op_cost_s(name, backward) for name, calls in ops)


def _count_ops(runner: UnitRunner) -> tuple[OpCounter, OpCounter]:
    """Aten ops of one forward and one backward, in a pass of their own: FlopCounterMode's
    module tracking dispatches views and detaches of its own that a real step does not."""
    args, leaves = runner.fresh_inputs()
    fwd_ops, bwd_ops = OpCounter(), OpCounter()
    with fwd_ops:
        outputs = list(runner.module(*args))
    grads = [torch.ones_like(o) for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
    with bwd_ops:
        has_backward = runner.backward(outputs, leaves, grads)
    if not has_backward:
        bwd_ops.counts.clear()
    elif runner.params:
        bwd_ops.counts[ACCUMULATE_OP] += len(runner.params)
    return fwd_ops, bwd_ops


def analytic_ms(counts: UnitCounts, preset: DevicePreset) -> tuple[float, float]:
    """Forward and backward milliseconds of one unit: roofline plus per-op costs.

    Counts without dispatched ops (made by hand or by older code) charge ``n_ops``
    forward ops and twice as many backward ones.
    """
    fwd = max(counts.fwd_flops / preset.flops_per_s, counts.fwd_bytes / preset.bytes_per_s)
    if counts.fwd_ops:
        fwd += op_overhead_s(counts.fwd_ops, preset, backward=False)
    else:
        fwd += counts.n_ops * preset.op_overhead_s * preset.cold_factor
    if not counts.has_backward:
        return fwd * 1e3, 0.0
    bwd = max(counts.bwd_flops / preset.flops_per_s, 2 * counts.fwd_bytes / preset.bytes_per_s)
    if counts.bwd_ops:
        bwd += op_overhead_s(counts.bwd_ops, preset, backward=True)
    else:
        bwd += 2 * counts.n_ops * preset.op_cost_s("", backward=True) * preset.cold_factor
    return fwd * 1e3, bwd * 1e3


@contextlib.contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """Run the block with ``count`` intra-op threads (``None``: leave as is)."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure_ms(runner: UnitRunner, device: str, warmup: int = 3, repeats: int = 7,
               cpu_threads: int | None = 1) -> tuple[float, float]:
    """Forward and backward milliseconds of one unit inside a running pipeline: the median
    of ``repeats`` warm runs (after ``warmup``) plus the cold-cache share of its op costs,
    ``(cold_factor - 1) x`` their warm cost (Note [analytic unit time]).

    The unit runs as one compiled call; on CPU with ``cpu_threads`` intra-op threads
    (default 1, what each torchrun worker gets). Backward is timed from ready-made
    gradients, so creating them is not charged.
    """
    fwd_ms, bwd_ms = _measure_warm_ms(runner, device, warmup, repeats, cpu_threads)
    preset = DEVICE_PRESETS.get(device)
    if preset is None or preset.cold_factor == 1.0:
        return fwd_ms, bwd_ms
    fwd_ops, bwd_ops = _count_ops(runner)
    share = (preset.cold_factor - 1.0) / preset.cold_factor  # op_overhead_s includes the factor
    fwd_ms += share * op_overhead_s(fwd_ops.items(), preset, backward=False) * 1e3
    if bwd_ms > 0:
        bwd_ms += share * op_overhead_s(bwd_ops.items(), preset, backward=True) * 1e3
    return fwd_ms, bwd_ms


def _measure_warm_ms(runner: UnitRunner, device: str, warmup: int, repeats: int,
                     cpu_threads: int | None) -> tuple[float, float]:
    """Median forward and backward milliseconds of back-to-back runs of one unit."""
    sync: Callable[[], None] = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fwd_times, bwd_times = [], []
    with _threads(cpu_threads if device == "cpu" else None):
        for i in range(warmup + repeats):
            sync()
            t0 = time.perf_counter()
            outputs, leaves = runner.forward()
            sync()
            t1 = time.perf_counter()
            grads = [torch.ones_like(o) for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
            sync()
            t2 = time.perf_counter()
            has_backward = runner.backward(outputs, leaves, grads)
            sync()
            t3 = time.perf_counter()
            if i >= warmup:
                fwd_times.append(t1 - t0)
                bwd_times.append(t3 - t2 if has_backward else 0.0)
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
