"""Unit times: the analytic estimate (roofline plus per-op costs) or a measurement.

Measured times run each unit as one compiled call (:class:`~fxpipe.tracer.measure.unit_runner.UnitRunner`)
and take medians over repeats after warm-up (CUDA synchronized). On CPU they are timed
with one intra-op thread, as each ``torchrun`` worker runs (``OMP_NUM_THREADS=1``).
See Note [analytic unit time] in :mod:`fxpipe.tracer.measure.calibration`.

Note [unit call cost]: timing a unit alone pays a fixed cost per call that a stage, which
runs all its units in one forward and one backward call, pays once per action: calling
the unit's GraphModule, and above all starting autograd's engine for the unit's own
``torch.autograd.grad``, several times a small op's cost. Summed over a small model's
units, that fixed cost would price a stage's backward far above what the stage, calling
the engine once, spends. So ``call_overhead_ms`` times a unit of one elementwise op on a tiny tensor
(the call, nearly no work) in the same loop, and ``measure_ms`` takes that off each
unit's forward and backward (keeping at least a tenth of each: a unit does some work).

Note [compiled unit times]: ``fxpipe trace --measure-times --compile`` times each unit as a
compiled stage runs it: the unit's GraphModule under ``torch.compile`` (inductor), forward and
backward (AOTAutograd compiles the backward at the first call, inside the warm-up). Compiling
is the costly part (seconds per unit), so repeated units, equal by
:func:`~fxpipe.tracer.measure.counting.unit_structure_key` (a transformer's blocks), are compiled and
timed once and share the times. No cold-cache share is added: it is priced per eager op
(Note [analytic unit time]), and a compiled unit runs fused kernels, not those ops. A compiled
call pays more than an eager one beyond its work (Dynamo's guards, AOTAutograd's wrappers
around the forward and the backward), and a compiled stage pays it once per action, not per
unit; so the call cost taken off (Note [unit call cost]) is that of the one-op unit compiled
(``call_overhead_ms(compiled=True)``), while the host's speed is still gauged eagerly.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from fxpipe.tracer.measure.calibration import DEVICE_PRESETS, DevicePreset, host_slowdown
from fxpipe.tracer.measure.counting import UnitCounts, count_ops, unit_structure_key
from fxpipe.tracer.measure.unit_runner import UnitInputs, UnitRunner

__all__ = [
    "analytic_ms",
    "ops_s",
    "roofline_ms",
    "op_overhead_s",
    "measure_ms",
    "call_overhead_ms",
    "gauge_call_ms",
    "time_units",
    "CompiledUnit",
]


def op_overhead_s(ops: Iterable[tuple[str, int]], preset: DevicePreset, backward: bool) -> float:
    """Fixed seconds of the ops ``(name, calls)`` on ``preset`` inside a running pipeline
    (warm-loop cost x ``cold_factor``, Note [analytic unit time])."""
    return preset.cold_factor * sum(calls * preset.op_cost_s(name, backward) for name, calls in ops)


def analytic_ms(counts: UnitCounts, preset: DevicePreset) -> tuple[float, float]:
    """Forward and backward milliseconds of one unit: roofline plus per-op costs, or the longer
    of the two where the device runs kernels while the host launches more (``preset.async_launch``,
    Note [asynchronous launch]).

    Counts without dispatched ops (made by hand or by older code) charge ``n_ops``
    forward ops and twice as many backward ones.
    """
    fwd_ops, bwd_ops = ops_s(counts, preset)
    return roofline_ms(
        preset,
        counts.fwd_flops,
        counts.bwd_flops,
        counts.fwd_bytes,
        fwd_ops,
        bwd_ops if counts.has_backward else None,
    )


def ops_s(counts: UnitCounts, preset: DevicePreset) -> tuple[float, float]:
    """The fixed per-op seconds of one unit's forward and backward (they do not follow the sizes)."""
    if counts.fwd_ops:
        fwd = op_overhead_s(counts.fwd_ops, preset, backward=False)
    else:
        fwd = counts.n_ops * preset.op_overhead_s * preset.cold_factor
    if counts.bwd_ops:
        bwd = op_overhead_s(counts.bwd_ops, preset, backward=True)
    else:
        bwd = 2 * counts.n_ops * preset.op_cost_s("", backward=True) * preset.cold_factor
    return fwd, bwd


def roofline_ms(
    preset: DevicePreset,
    fwd_flops: float,
    bwd_flops: float,
    fwd_bytes: float,
    fwd_ops_s: float,
    bwd_ops_s: float | None,
) -> tuple[float, float]:
    """:func:`analytic_ms` from the counts themselves (``bwd_ops_s`` None: no backward); what
    re-pricing a profile at other sizes evaluates (Note [costs at other sizes])."""
    combine = max if preset.async_launch else (lambda roofline, ops: roofline + ops)
    roofline = max(fwd_flops / preset.flops_per_s, fwd_bytes / preset.bytes_per_s)
    fwd = combine(roofline, fwd_ops_s)
    if bwd_ops_s is None:
        return fwd * 1e3, 0.0
    roofline = max(bwd_flops / preset.flops_per_s, 2 * fwd_bytes / preset.bytes_per_s)
    return fwd * 1e3, combine(roofline, bwd_ops_s) * 1e3


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


class _Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


class _CallOnly:
    """A unit of one elementwise op on 8 numbers, run as ``UnitRunner`` runs one: the cost of a
    call beyond its work (Note [unit call cost])."""

    backward = staticmethod(UnitRunner.backward)

    def __init__(self, device: str, compiled: bool = False) -> None:
        self.device = device
        traced = torch.fx.symbolic_trace(_Scale())
        self.module = torch.compile(traced, dynamic=False) if compiled else traced

    def fresh_inputs(self) -> UnitInputs:
        x = torch.ones(8, device=self.device, requires_grad=True)
        return UnitInputs((x,), (x,), ())

    def run(self, inputs: UnitInputs) -> list[Any]:
        return [self.module(*inputs.args)]


def call_overhead_ms(
    device: str,
    cpu_threads: int | None = 1,
    warmup: int = 5,
    repeats: int = 31,
    compiled: _CallOnly | None = None,
) -> tuple[float, float]:
    """Forward and backward milliseconds of calling a unit that does (nearly) nothing
    (Note [unit call cost]); also the gauge of the host's speed (Note [host speed]).
    ``compiled``: that unit compiled (``_CallOnly(device, compiled=True)``, made once: Note
    [compiled unit times])."""
    return _measure_warm_ms(
        compiled or _CallOnly(device),
        device,
        warmup=warmup,
        repeats=repeats,
        cpu_threads=cpu_threads,
    )


def gauge_call_ms(device: str) -> tuple[float, float]:
    """One sample of the call cost, as a trace takes it right before each unit: the host's speed
    at that moment (Note [host speed]; ``CPU_CALL_MS`` was calibrated with the same sample)."""
    return call_overhead_ms(device, warmup=2, repeats=11)


class CompiledUnit:
    """A unit run as a compiled stage runs it: its module under ``torch.compile``
    (Note [compiled unit times]); the same inputs and backward as its :class:`UnitRunner`."""

    backward = staticmethod(UnitRunner.backward)

    def __init__(self, runner: UnitRunner) -> None:
        self.runner = runner
        self.compiled = torch.compile(runner.module, dynamic=False)

    def fresh_inputs(self) -> UnitInputs:
        return self.runner.fresh_inputs()

    def run(self, inputs: UnitInputs) -> list[Any]:
        return list(self.compiled(*inputs.args))


def measure_ms(
    runner: UnitRunner | CompiledUnit,
    device: str,
    warmup: int = 3,
    repeats: int = 7,
    cpu_threads: int | None = 1,
    call_ms: tuple[float, float] = (0.0, 0.0),
    slowdown: float = 1.0,
) -> tuple[float, float]:
    """Forward and backward milliseconds of one unit inside a running pipeline: the median
    of ``repeats`` warm runs (after ``warmup``) plus the cold-cache share of its op costs,
    ``(cold_factor - 1) x`` their warm cost (Note [analytic unit time]).

    The unit runs as one compiled call; on CPU with ``cpu_threads`` intra-op threads
    (default 1, what each torchrun worker gets). Backward is timed from ready-made
    gradients, so creating them is not charged. ``call_ms`` (``call_overhead_ms``): the
    fixed forward and backward cost of the call itself, taken off (Note [unit call cost]).
    ``slowdown``: the host's (``host_slowdown``), which the cold-cache share, priced from the
    calibration host's op costs, is scaled by (Note [host speed]).
    """
    fwd_ms, bwd_ms = _measure_warm_ms(runner, device, warmup, repeats, cpu_threads)
    fwd_ms = max(fwd_ms - call_ms[0], 0.1 * fwd_ms)
    bwd_ms = max(bwd_ms - call_ms[1], 0.1 * bwd_ms)
    preset = DEVICE_PRESETS.get(device)
    if preset is None or preset.cold_factor == 1.0 or isinstance(runner, CompiledUnit):
        return fwd_ms, bwd_ms
    fwd_ops, bwd_ops = count_ops(runner)
    share = (
        slowdown * (preset.cold_factor - 1.0) / preset.cold_factor
    )  # op_overhead_s includes the factor
    fwd_ms += share * op_overhead_s(fwd_ops.items(), preset, backward=False) * 1e3
    if bwd_ms > 0:
        bwd_ms += share * op_overhead_s(bwd_ops.items(), preset, backward=True) * 1e3
    return fwd_ms, bwd_ms


def time_units(
    runners: Sequence[UnitRunner],
    device: str,
    iterate: Callable[[Sequence[UnitRunner]], Iterable[UnitRunner]] = iter,
    compiled: bool = False,
) -> tuple[list[tuple[float, float]], float | None]:
    """Every unit's forward and backward ms (``measure_ms``) and the host's call cost over the
    trace (``None`` without units): the median of the ``gauge_call_ms`` samples taken right
    before each unit, each of which its unit's timing uses (Note [unit call cost], Note [host
    speed]). ``iterate`` wraps the walk over the units (a progress bar). ``compiled``: each
    unit under ``torch.compile``, repeated units compiled and timed once (Note [compiled unit
    times])."""
    call_overhead_ms(device)  # warm the call's path before the first sample
    compiled_call = _CallOnly(device, compiled=True) if compiled else None
    if compiled_call is not None:
        call_overhead_ms(device, compiled=compiled_call)  # compiles it, warms its path
    times, samples = [], []
    seen: dict[Any, tuple[float, float]] = {}
    for runner in iterate(runners):
        key = unit_structure_key(runner) if compiled else None
        if compiled and key in seen:
            times.append(seen[key])
            continue
        call = gauge_call_ms(device)
        samples.append(call[0] + call[1])
        timed = CompiledUnit(runner) if compiled else runner
        if compiled_call is not None:  # a compiled call's own cost (Note [compiled unit times])
            call = call_overhead_ms(device, warmup=2, repeats=11, compiled=compiled_call)
        times.append(
            measure_ms(timed, device, call_ms=call, slowdown=host_slowdown(device, samples[-1]))
        )
        if compiled:
            seen[key] = times[-1]
    return times, statistics.median(samples) if samples else None


def _measure_warm_ms(
    runner: UnitRunner | CompiledUnit | _CallOnly,
    device: str,
    warmup: int,
    repeats: int,
    cpu_threads: int | None,
) -> tuple[float, float]:
    """Median forward and backward milliseconds of back-to-back runs of one unit."""
    sync: Callable[[], None] = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fwd_times, bwd_times = [], []
    with _threads(cpu_threads if device == "cpu" else None):
        for i in range(warmup + repeats):
            inputs = runner.fresh_inputs()  # copies are not charged (Note [fresh unit inputs])
            sync()
            t0 = time.perf_counter()
            outputs = runner.run(inputs)
            sync()
            t1 = time.perf_counter()
            grads = [
                torch.ones_like(o)
                for o in outputs
                if isinstance(o, torch.Tensor) and o.requires_grad
            ]
            sync()
            t2 = time.perf_counter()
            has_backward = runner.backward(outputs, inputs.leaves, grads)
            sync()
            t3 = time.perf_counter()
            if i >= warmup:
                fwd_times.append(t1 - t0)
                bwd_times.append(t3 - t2 if has_backward else 0.0)
    return statistics.median(fwd_times) * 1e3, statistics.median(bwd_times) * 1e3
