"""Unit costs (analytic and measured), JSON round trip, the networkx view and the table."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
from rich.console import Console

from fxpipe.tracer import ModelProfile, print_profile_table, trace_model


class _BigSmall(nn.Module):
    """A large matmul unit next to a tiny one, so any sane cost model orders them."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(512, 512)
        self.small = nn.Linear(512, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(torch.relu(self.big(x)))


@pytest.fixture(scope="module")
def both_modes():
    x = (torch.randn(64, 512),)
    model = _BigSmall()
    return trace_model(model, x, progress=False), trace_model(
        model, x, measure_times=True, progress=False
    )


def test_costs_positive_in_both_modes(both_modes):
    for traced in both_modes:
        for unit in traced.profile.units:
            assert unit.fwd_ms > 0 and unit.bwd_ms > 0, unit
    analytic, measured = both_modes
    assert analytic.profile.timing == "analytic" and measured.profile.timing == "measured"


def test_measured_and_analytic_agree_on_ordering(both_modes):
    for traced in both_modes:
        units = {u.module_path: u for u in traced.profile.units}
        assert units["big"].fwd_ms > units["small"].fwd_ms
        assert units["big"].compute_ms > units["small"].compute_ms


def test_flops_params_and_activations(both_modes):
    units = {u.module_path: u for u in both_modes[0].profile.units}
    assert units["big"].fwd_flops == 2 * 64 * 512 * 512
    assert units["big"].param_bytes == (512 * 512 + 512) * 4
    # big saves x for its weight gradient and relu saves its output; `small` saves that same
    # output as its input, which is charged once, to its producer (64x512 floats each)
    assert units["big"].activation_bytes == 2 * 64 * 512 * 4
    assert units["small"].activation_bytes == 0
    assert units["big"].outputs[0].nbytes == 64 * 512 * 4
    edge = both_modes[0].profile.edges[0]
    assert edge.bytes == 64 * 512 * 4


def test_saved_tensors_counts_every_pack_of_a_unit_on_real_and_meta_tensors(both_modes):
    # Note [recompute cost]: a checkpoint region pays per saved tensor, shared storage or not.
    # big: addmm saves its input and the weight's transpose, relu its output; small: addmm's two
    for traced in both_modes:
        assert {u.module_path: u.saved_tensors for u in traced.profile.units} == {
            "big": 3,
            "small": 2,
        }
    with torch.device("meta"):
        model = _BigSmall()
    meta = trace_model(model, (torch.randn(64, 512, device="meta"),), progress=False)
    assert meta.profile.meta and [u.saved_tensors for u in meta.profile.units] == [3, 2]


def test_analytic_mode_is_deterministic():
    x = (torch.randn(8, 512),)
    a = trace_model(_BigSmall(), x, progress=False).profile
    b = trace_model(_BigSmall(), x, progress=False).profile
    assert [(u.fwd_ms, u.bwd_ms, u.activation_bytes) for u in a.units] == [
        (u.fwd_ms, u.bwd_ms, u.activation_bytes) for u in b.units
    ]


def test_profile_json_round_trip_and_graph(both_modes, tmp_path):
    profile = both_modes[0].profile
    path = tmp_path / "profile.json"
    profile.to_json(path)
    loaded = ModelProfile.from_json(path)
    assert loaded == profile
    g = loaded.graph()
    assert list(g.nodes) == [u.name for u in profile.units]
    assert all(g[e.src][e.dst]["bytes"] == e.bytes for e in profile.edges)


def test_integer_input_unit_has_no_backward():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    profile = trace_model(model, (torch.randint(0, 10, (3, 5)),), progress=False).profile
    assert profile.inputs[0].requires_grad is False
    assert all(u.bwd_ms > 0 for u in profile.units)  # both have parameters to differentiate


def test_print_profile_table(both_modes):
    buffer = io.StringIO()
    print_profile_table(both_modes[0].profile, console=Console(file=buffer, width=160))
    text = buffer.getvalue()
    assert "big" in text and "Linear" in text and "total" in text and "1.0 MiB" in text


# -- the analytic cost terms, on hand-made counts (Note [analytic unit time]) -----------------

from fxpipe.tracer import api as _api  # noqa: E402
from fxpipe.tracer.measure.calibration import ACCUMULATE_OP, DEVICE_PRESETS, DevicePreset  # noqa: E402
from fxpipe.tracer.measure.counting import OpCounter, UnitCounts  # noqa: E402
from fxpipe.tracer.measure.timing import analytic_ms  # noqa: E402

_PRESET = DevicePreset(
    "test",
    flops_per_s=1e9,
    bytes_per_s=1e9,
    op_overhead_s=1e-6,
    bwd_op_overhead_s=2e-6,
    op_extra_s=(("convolution", 10e-6),),
    cold_factor=2.0,
)


def test_analytic_ms_literal_roofline_plus_op_costs():
    counts = UnitCounts(
        fwd_flops=2e6,
        bwd_flops=4e6,
        fwd_bytes=1_000_000,
        activation_bytes=0,
        n_ops=9,
        has_backward=True,
        fwd_ops=(("addmm", 3), ("convolution", 1)),
        bwd_ops=(("mm", 4),),
    )
    fwd, bwd = analytic_ms(counts, _PRESET)
    # forward: max(2 ms flops, 1 ms bytes) + 2 x (3 x 1 us + 1 x (1 + 10) us)
    assert fwd == pytest.approx(2.0 + 0.028)
    # backward: max(4 ms flops, 2 x 1 ms bytes) + 2 x 4 x 2 us
    assert bwd == pytest.approx(4.0 + 0.016)


def test_analytic_ms_without_op_counts_and_without_backward():
    counts = UnitCounts(
        fwd_flops=0.0, bwd_flops=0.0, fwd_bytes=0, activation_bytes=0, n_ops=5, has_backward=True
    )
    assert analytic_ms(counts, _PRESET) == pytest.approx((5 * 1e-3 * 2, 2 * 5 * 2e-3 * 2))
    frozen = UnitCounts(
        fwd_flops=1e6,
        bwd_flops=0.0,
        fwd_bytes=0,
        activation_bytes=0,
        n_ops=1,
        has_backward=False,
        fwd_ops=(("relu", 1),),
    )
    assert analytic_ms(frozen, _PRESET) == pytest.approx((1.0 + 0.002, 0.0))


def test_analytic_ms_async_launch_takes_the_longer_of_roofline_and_ops():
    # Note [asynchronous launch]: the host launches while the device runs, so a unit costs the longer
    overlapped = replace(_PRESET, async_launch=True)
    compute_bound = UnitCounts(
        fwd_flops=2e6,
        bwd_flops=4e6,
        fwd_bytes=1_000_000,
        activation_bytes=0,
        n_ops=9,
        has_backward=True,
        fwd_ops=(("addmm", 3), ("convolution", 1)),
        bwd_ops=(("mm", 4),),
    )
    assert analytic_ms(compute_bound, overlapped) == pytest.approx((2.0, 4.0))
    launch_bound = UnitCounts(
        fwd_flops=1e3,
        bwd_flops=2e3,
        fwd_bytes=1_000,
        activation_bytes=0,
        n_ops=9,
        has_backward=True,
        fwd_ops=(("add", 100),),
        bwd_ops=(("mul", 100),),
    )
    # forward: 2 x 100 x 1 us = 0.2 ms over a 0.001 ms roofline; backward: 2 x 100 x 2 us
    assert analytic_ms(launch_bound, overlapped) == pytest.approx((0.2, 0.4))
    assert analytic_ms(launch_bound, _PRESET) == pytest.approx((0.2 + 0.001, 0.4 + 0.002))


def test_only_the_cuda_preset_overlaps_launch_and_compute():
    assert DEVICE_PRESETS["cuda"].async_launch and not DEVICE_PRESETS["cpu"].async_launch


def test_cpu_preset_charges_convolutions_extra():
    cpu = DEVICE_PRESETS["cpu"]
    assert cpu.op_cost_s("convolution", backward=False) > 5 * cpu.op_cost_s("add", backward=False)
    assert cpu.op_cost_s("add", backward=True) == cpu.bwd_op_overhead_s


def test_op_counter_counts_aten_ops_by_name():
    x = torch.randn(3)
    with OpCounter() as counter:
        torch.relu(x) + 1
    assert counter.items() == (("add", 1), ("relu", 1))


def test_unit_op_counts_and_compiled_unit(monkeypatch):
    seen = []

    def spy(runner):
        counts = count_unit(runner)
        seen.append((runner, counts))
        return counts

    count_unit = _api.count_unit
    monkeypatch.setattr(_api, "count_unit", spy)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    x = torch.randn(2, 4)
    trace_model(model, (x,), progress=False)
    (lin_runner, lin), (_, relu) = seen
    assert dict(lin.fwd_ops)["addmm"] == 1
    assert dict(lin.bwd_ops)[ACCUMULATE_OP] == 2  # weight and bias
    assert dict(relu.fwd_ops)["relu"] == 1 and ACCUMULATE_OP not in dict(relu.bwd_ops)
    outputs, leaves = lin_runner.forward()  # the unit as one compiled GraphModule call
    torch.testing.assert_close(outputs[0], model[0](x))
    assert len(leaves) == 3  # the (float) input and both parameters


def test_measured_unit_times_leave_out_the_call_cost(monkeypatch):
    # Note [unit call cost]: the cost of calling a unit at all comes off each unit, a tenth of each stays
    from fxpipe.tracer.measure import timing

    monkeypatch.setattr(timing, "_measure_warm_ms", lambda *args: (0.05, 0.2))
    no_preset = "mps"  # no cold-cache share to add: the warm loop's figures as they are
    assert timing.measure_ms(None, no_preset) == pytest.approx((0.05, 0.2))
    assert timing.measure_ms(None, no_preset, call_ms=(0.01, 0.05)) == pytest.approx((0.04, 0.15))
    assert timing.measure_ms(None, no_preset, call_ms=(1.0, 1.0)) == pytest.approx((0.005, 0.02))


def test_call_cost_is_a_unit_that_does_nearly_nothing():
    from fxpipe.tracer.measure.timing import call_overhead_ms

    fwd, bwd = call_overhead_ms("cpu")
    assert 0 < fwd < 1 and 0 < bwd < 1  # milliseconds: a call, not work
    assert bwd > fwd  # the backward starts autograd's engine
