"""Note [host speed]: a measured trace gauges the host's speed and the fixed costs follow it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from fxpipe.tracer import trace_model
from fxpipe.tracer.measure.calibration import DEVICE_PRESETS, host_slowdown
from fxpipe.tracer.profile import ModelProfile, Unit


def test_slowdown_is_the_gauge_over_the_calibration_hosts_quiet_gauge() -> None:
    quiet = DEVICE_PRESETS["cpu"].call_ms
    assert quiet and quiet > 0
    assert host_slowdown("cpu", 2 * quiet) == pytest.approx(2.0)
    assert host_slowdown("cpu", quiet / 2) == pytest.approx(
        0.5
    )  # a faster host: cheaper fixed costs
    assert host_slowdown("cpu", None) == 1.0  # times not measured: the calibration's speed
    assert host_slowdown("cpu", 0.0) == 1.0  # a hand-written zero is no reading
    assert (
        DEVICE_PRESETS["cuda"].call_ms is None and host_slowdown("cuda", 5.0) == 1.0
    )  # not calibrated there
    assert host_slowdown("mps", 5.0) == 1.0  # no preset at all


def test_profile_records_the_gauge_and_old_profiles_read_as_the_calibration_speed() -> None:
    quiet = DEVICE_PRESETS["cpu"].call_ms
    assert quiet is not None
    profile = ModelProfile(
        units=(Unit(name="u", module_path="u", fwd_ms=1.0, bwd_ms=2.0),),
        edges=(),
        batch_size=1,
        host_call_ms=3 * quiet,
    )
    again = ModelProfile.from_json(profile.to_json())
    assert again.host_call_ms == pytest.approx(3 * quiet) and again.host_slowdown == pytest.approx(
        3.0
    )
    old = profile.to_dict()
    del old["host_call_ms"]  # written before the gauge existed
    assert ModelProfile.from_dict(old).host_slowdown == 1.0
    assert replace(profile, trace_device="cuda").host_slowdown == 1.0


def test_measured_trace_gauges_the_host_and_an_analytic_one_does_not() -> None:
    model, x = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)), (torch.randn(4, 16),)
    measured = trace_model(model, x, measure_times=True, progress=False).profile
    analytic = trace_model(model, x, progress=False).profile
    assert analytic.host_call_ms is None and analytic.host_slowdown == 1.0
    assert measured.host_call_ms is not None and 0 < measured.host_call_ms < 1.0  # a call, in ms
    assert 0.1 < measured.host_slowdown < 20  # this host against its own calibration: same order


def test_each_unit_takes_off_and_scales_by_the_gauge_sampled_right_before_it(monkeypatch) -> None:
    from fxpipe.tracer.measure import timing

    quiet = DEVICE_PRESETS["cpu"].call_ms
    assert quiet is not None
    gauges = iter(
        [(0.0, quiet)] + [(0.0, quiet), (0.0, 3 * quiet), (0.0, 2 * quiet)]
    )  # warm-up, then one per unit
    monkeypatch.setattr(timing, "call_overhead_ms", lambda *a, **k: next(gauges))
    seen = []
    monkeypatch.setattr(
        timing,
        "measure_ms",
        lambda r, device, call_ms, slowdown: seen.append((call_ms, slowdown)) or (1.0, 2.0),
    )
    times, call_ms = timing.time_units(["a", "b", "c"], "cpu")  # type: ignore[list-item]
    assert times == [(1.0, 2.0)] * 3
    assert call_ms == pytest.approx(2 * quiet)  # the median of the three samples
    assert [s for _, s in seen] == pytest.approx([1.0, 3.0, 2.0])
    assert [c for c, _ in seen] == [(0.0, quiet), (0.0, 3 * quiet), (0.0, 2 * quiet)]


def test_cold_cache_share_follows_the_host(monkeypatch) -> None:
    # the warm loop's time already carries the host's speed; the cold share added to it is priced
    # from the calibration host's op costs, so it is scaled by the slowdown
    from fxpipe.tracer.measure import timing

    monkeypatch.setattr(timing, "_measure_warm_ms", lambda *args: (1.0, 2.0))
    monkeypatch.setattr(timing, "count_ops", lambda runner: ({"addmm": 10}, {"mm": 20}))
    fwd1, bwd1 = timing.measure_ms(None, "cpu")
    fwd2, bwd2 = timing.measure_ms(None, "cpu", slowdown=2.0)
    assert fwd1 > 1.0 and bwd1 > 2.0
    assert fwd2 - 1.0 == pytest.approx(2 * (fwd1 - 1.0)) and bwd2 - 2.0 == pytest.approx(
        2 * (bwd1 - 2.0)
    )
