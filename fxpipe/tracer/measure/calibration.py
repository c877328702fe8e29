"""Device calibration for the analytic unit time: one :class:`DevicePreset` per trace device.

Note [analytic unit time]: ``max(flops / peak, bytes / bandwidth)`` plus a fixed cost
per dispatched aten op (forward and backward counted separately while the unit runs
under a dispatch mode, with an extra cost for op kinds that are slow at small sizes,
such as convolutions), with one :class:`DevicePreset` per trace device. Backward reads
roughly twice the forward's bytes and also pays one gradient accumulation per
parameter (microbatches after the first add into ``.grad``). The per-op costs are what
makes small models' times right: a width-32 GPT block dispatches ~110 aten ops per
forward for only ~2 MFLOP, so its time is nearly all fixed costs, which a flops-only
roofline leaves out. The figures of each preset are fitted per device and kept, with
where they were measured, in ``fxpipe/calibration.json`` (Note [calibration data] in
:mod:`fxpipe.calibration_data`).

Note [asynchronous launch]: on the CPU the thread that dispatches an op also runs it, so a
unit costs its roofline plus its ops' fixed costs. A CUDA host only enqueues kernels: while
the GPU runs one, the host launches the next, so a unit costs the longer of the two
(``DevicePreset.async_launch``). The sum over-prices a compute-bound model at any rate the
card has; the longer-of-the-two fits compute-bound and launch-bound models with one rate
and one per-op cost. A whole stage overlaps more than one unit does (a matmul's kernel runs
while the next unit's elementwise ops launch), so even the longer-of-the-two per unit stays
above the stage where the two are close, and so do measured unit times.

Note [host speed]: measured unit times carry the host's speed at the moment of the trace,
but the fixed costs a prediction adds (the cold-cache share of each unit's op costs here,
the runtime's per-action, per-message and per-step costs in ``RuntimeCosts``) are constants
calibrated on one host at its quiet speed. On a slower host, or on a shared one while it
runs slow, the two disagree, and the step's fixed part, half or more of a small model's
step, is under-priced. So a measured trace also times the fixed cost of calling a unit
(``call_overhead_ms``: pure Python, dispatch and autograd-engine work, the kind the
runtime's fixed costs are) beside every unit, records their median in the profile
(``ModelProfile.host_call_ms``), and ``host_slowdown`` prices every fixed cost at that
speed: the measured call cost over ``DevicePreset.call_ms``, the same gauge on the
calibration host at its quiet speed. The model assumes the fixed costs slow down as the
call cost does. The gauge follows the host only partly (a slow stretch slows it less than
it slows a model's forward and backward), and it reads the trace's moment, not the run's:
a trace in a slow stretch before a quiet run over-prices the run.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxpipe.calibration_data import names, values

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
    Note [host speed]). ``compile_factor``: a unit's time under ``torch.compile`` over its eager
    time, what ``--compile`` scales analytic times by (Note [compiled unit times] in
    :mod:`fxpipe.tracer.measure.timing`).
    """

    name: str
    flops_per_s: float
    bytes_per_s: float
    op_overhead_s: float
    bwd_op_overhead_s: float | None = None
    op_extra_s: tuple[tuple[str, float], ...] = ()
    cold_factor: float = 1.0
    async_launch: bool = (
        False  # kernels run while the host launches more (Note [asynchronous launch])
    )
    call_ms: float | None = (
        None  # the calibration host's call cost at its quiet speed (Note [host speed])
    )
    compile_factor: float = 1.0  # a compiled unit's time over its eager time (--compile, analytic)

    def op_cost_s(self, op: str, backward: bool) -> float:
        """Seconds of fixed cost for one call of aten op ``op`` in a warm loop."""
        base = (
            self.bwd_op_overhead_s
            if backward and self.bwd_op_overhead_s is not None
            else self.op_overhead_s
        )
        return base + dict(self.op_extra_s).get(op, 0.0)


def _preset(name: str) -> DevicePreset:
    """The device preset ``name`` as ``calibration.json`` gives it (Note [calibration data])."""
    figures = values("device_presets", name)
    extra = figures.pop("op_extra_s", {})
    return DevicePreset(name, op_extra_s=tuple(extra.items()), **figures)


DEVICE_PRESETS: dict[str, DevicePreset] = {name: _preset(name) for name in names("device_presets")}
# the calibration host's call cost at its quiet speed, ms (Note [host speed])
CPU_CALL_MS: float = values("device_presets", "cpu")["call_ms"]


def host_slowdown(device: str, call_ms: float | None) -> float:
    """How much slower than the calibration host's quiet speed a host ran, from the call cost
    a trace measured on it (``ModelProfile.host_call_ms``); 1.0 where either is unknown
    (Note [host speed])."""
    preset = DEVICE_PRESETS.get(device)
    if (
        not call_ms or preset is None or not preset.call_ms
    ):  # a zero gauge (hand-written) is no reading
        return 1.0
    return call_ms / preset.call_ms
