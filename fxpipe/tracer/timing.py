"""Unit times: the analytic estimate (roofline plus per-op costs) or a measurement.

Measured times run each unit as one compiled call (:class:`~fxpipe.tracer.unit_runner.UnitRunner`)
and take medians over repeats after warm-up (CUDA synchronized). On CPU they are timed
with one intra-op thread, as each ``torchrun`` worker runs (``OMP_NUM_THREADS=1``).
See Note [analytic unit time] in :mod:`fxpipe.tracer.calibration`.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable, Iterable, Iterator

import torch

from fxpipe.tracer.calibration import DEVICE_PRESETS, DevicePreset
from fxpipe.tracer.counting import UnitCounts, count_ops
from fxpipe.tracer.unit_runner import UnitRunner

__all__ = ["analytic_ms", "op_overhead_s", "measure_ms"]


def op_overhead_s(ops: Iterable[tuple[str, int]], preset: DevicePreset, backward: bool) -> float:
    """Fixed seconds of the ops ``(name, calls)`` on ``preset`` inside a running pipeline
    (warm-loop cost x ``cold_factor``, Note [analytic unit time])."""
    return preset.cold_factor * sum(calls * preset.op_cost_s(name, backward) for name, calls in ops)


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
    fwd_ops, bwd_ops = count_ops(runner)
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
            inputs = runner.fresh_inputs()  # copies are not charged (Note [fresh unit inputs])
            sync()
            t0 = time.perf_counter()
            outputs = runner.run(inputs)
            sync()
            t1 = time.perf_counter()
            grads = [torch.ones_like(o) for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
            sync()
            t2 = time.perf_counter()
            has_backward = runner.backward(outputs, inputs.leaves, grads)
            sync()
            t3 = time.perf_counter()
            if i >= warmup:
                fwd_times.append(t1 - t0)
                bwd_times.append(t3 - t2 if has_backward else 0.0)
    return statistics.median(fwd_times) * 1e3, statistics.median(bwd_times) * 1e3
