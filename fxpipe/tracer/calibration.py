"""Device calibration for the analytic unit time: one :class:`DevicePreset` per trace device.

Note [analytic unit time]: ``max(flops / peak, bytes / bandwidth)`` plus a fixed cost
per dispatched aten op (forward and backward counted separately while the unit runs
under a dispatch mode, with an extra cost for op kinds that are slow at small sizes,
such as convolutions), with one :class:`DevicePreset` per trace device. Backward reads
roughly twice the forward's bytes and also pays one gradient accumulation per
parameter (microbatches after the first add into ``.grad``). On small models the op
costs dominate: a 4-layer width-32 GPT block runs ~110 aten ops per forward for only
~2 MFLOP, which is why a flops-only roofline predicted a third of the real step.

Note [asynchronous launch]: on the CPU the thread that dispatches an op also runs it, so a
unit costs its roofline plus its ops' fixed costs. A CUDA host only enqueues kernels: while
the GPU runs one, the host launches the next, so a unit costs the longer of the two
(``DevicePreset.async_launch``). On an H100 (benchmarks/prediction/one_gpu.py, 2026-11-26)
the sum put a GPT of width 1024 (670 GFLOP and ~1,100 ops per microbatch) at 1.5-2x its
measured step at any fp32 rate the card has; the longer-of-the-two fits it and the small
GPTs, which are launch-bound, with one rate and one per-op cost. A whole stage overlaps
more than one unit does (a matmul's kernel runs while the next unit's elementwise ops
launch), so even the longer-of-the-two per unit stays above the stage where the two are
close; measured unit times share that (benchmarks/prediction/README.md).

Note [host speed]: measured unit times carry the host's speed at the moment of the trace,
but the fixed costs a prediction adds (the cold-cache share of each unit's op costs here,
the runtime's per-action, per-message and per-step costs in ``RuntimeCosts``) are constants
calibrated on one host at its quiet speed. On a slower host, or on this project's shared
VM while it runs slow (up to 3x for seconds at a time), the two disagree, and the step's
fixed part, half or more of a small model's step, was under-priced: the S x R benchmark's
measured / predicted ratio climbed from ~1.0 on a quiet host to 1.17-1.26 on a slowed one
(benchmarks/prediction/README.md). So a measured trace also times the fixed cost of
calling a unit (``call_overhead_ms``, pure Python, dispatch and autograd-engine work, the
kind the runtime's fixed costs are) beside every unit, records their median in the
profile (``ModelProfile.host_call_ms``), and ``host_slowdown`` prices every fixed cost at
that speed: the measured call cost over ``DevicePreset.call_ms``, the same measurement on
the calibration host at its quiet speed. The gauge follows the host only partly (on this
project's VM it slowed 1.6x where a small model's forward + backward slowed 1.9x, and barely
in milder stretches: benchmarks/prediction/host_speed.md), and it reads the trace's moment,
not the run's: a trace in a slow stretch before a quiet run over-prices the run.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DevicePreset", "DEVICE_PRESETS", "ACCUMULATE_OP", "host_slowdown"]

ACCUMULATE_OP = "accumulate_grad"  # pseudo-op: one gradient accumulation per parameter in backward


@dataclass(frozen=True)
class DevicePreset:
    """Roofline parameters of a device class (fp32), Note [analytic unit time].

    ``op_overhead_s`` is the fixed cost of one forward aten op in a warm loop,
    ``bwd_op_overhead_s`` that of one backward op (``None``: the same); ``op_extra_s``
    adds, per op name (the aten overload packet, e.g. ``"convolution_backward"``), a cost
    on top. ``cold_factor`` scales these fixed costs to what they are inside a running
    pipeline, where each action starts with cold caches after waiting on its peers.
    ``async_launch``: a unit costs the longer of its roofline and its op costs, not their sum
    (Note [asynchronous launch]). ``call_ms``: forward + backward ms of ``call_overhead_ms`` on
    the host these figures were calibrated on, at its quiet speed (``None``: not calibrated;
    Note [host speed]).
    """

    name: str
    flops_per_s: float
    bytes_per_s: float
    op_overhead_s: float
    bwd_op_overhead_s: float | None = None
    op_extra_s: tuple[tuple[str, float], ...] = ()
    cold_factor: float = 1.0
    async_launch: bool = False  # kernels run while the host launches more (Note [asynchronous launch])
    call_ms: float | None = None  # the calibration host's call cost at its quiet speed (Note [host speed])

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
# "cuda": fitted to an H100 80GB (SXM) under torch 2.11 + CUDA 13, fp32 without TF32, from the
# one-rank steps of benchmarks/prediction/one_gpu.py (2026-11-26, two runs): the small GPTs,
# launch-bound, took 13-19 us per dispatched op (forward and backward alike; the host's speed
# moved them by 1.5x between the runs), and the width-1024 GPT fits 50 TFLOP/s (the card's fp32
# peak is 67) beside 15 us per op (Note [asynchronous launch]); 2.5 TB/s of its 3.35 for
# elementwise traffic. On another GPU, one_gpu.py there shows how far these figures are off.
# CPU_CALL_MS: ``call_overhead_ms("cpu")``'s forward + backward sampled as a trace samples it,
# on this project's machine while its speed probe (benchmarks/prediction/configurations.py)
# read its quiet 2.4-2.5 ms, the speed the "cpu" figures here and in RUNTIME_COSTS were
# calibrated at (benchmarks/prediction/host_speed.py).
CPU_CALL_MS = 0.034  # ms: 33.8 us measured (host_speed.md, 2026-11-27)
DEVICE_PRESETS: dict[str, DevicePreset] = {
    "cpu": DevicePreset("cpu", flops_per_s=75e9, bytes_per_s=20e9, op_overhead_s=3.0e-6, bwd_op_overhead_s=2.8e-6,
                        op_extra_s=(("convolution", 40e-6), ("convolution_backward", 90e-6),
                                    ("native_batch_norm", 10e-6), ("native_batch_norm_backward", 3e-6)),
                        cold_factor=1.45, call_ms=CPU_CALL_MS),
    "cuda": DevicePreset("cuda", flops_per_s=50e12, bytes_per_s=2.5e12, op_overhead_s=15e-6, async_launch=True),
}


def host_slowdown(device: str, call_ms: float | None) -> float:
    """How much slower than the calibration host's quiet speed a host ran, from the call cost
    a trace measured on it (``ModelProfile.host_call_ms``); 1.0 where either is unknown
    (Note [host speed])."""
    preset = DEVICE_PRESETS.get(device)
    if not call_ms or preset is None or not preset.call_ms:  # a zero gauge (hand-written) is no reading
        return 1.0
    return call_ms / preset.call_ms
