"""`--compile` prices the units as compiled stages run them (Note [compiled unit times])."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fxpipe.calibration_data import values
from fxpipe.errors import TraceError
from fxpipe.tracer import trace_model
from fxpipe.tracer.measure.calibration import DEVICE_PRESETS
from fxpipe.tracer.measure.counting import unit_structure_key
from fxpipe.tracer.profile import ModelProfile


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) + x


def _model() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return nn.Sequential(*[_Block() for _ in range(4)], nn.Linear(16, 4)), (torch.randn(4, 16),)


def test_analytic_times_take_the_measured_compiled_kernel_factor() -> None:
    model, x = _model()
    eager = trace_model(model, x, progress=False).profile
    compiled = trace_model(model, x, compile=True, progress=False).profile
    factor = DEVICE_PRESETS["cpu"].compile_factor
    assert factor == values("device_presets", "cpu")["compile_factor"]  # calibration.json's
    assert not eager.compiled and eager.compile_factor is None
    assert compiled.compiled and compiled.compile_factor == factor
    for e, c in zip(eager.units, compiled.units):
        assert c.fwd_ms == pytest.approx(e.fwd_ms * factor)
        assert c.bwd_ms == pytest.approx(e.bwd_ms * factor)
    given = trace_model(model, x, compile=True, compile_factor=0.5, progress=False).profile
    assert given.compile_factor == 0.5
    assert given.units[0].fwd_ms == pytest.approx(eager.units[0].fwd_ms * 0.5)


def test_a_compile_factor_without_compile_or_with_measured_times_is_refused() -> None:
    model, x = _model()
    with pytest.raises(TraceError, match="compile_factor prices compiled stages"):
        trace_model(model, x, compile_factor=0.5, progress=False)
    with pytest.raises(TraceError, match="compile_factor scales analytic times"):
        trace_model(model, x, compile=True, compile_factor=0.5, measure_times=True, progress=False)


def test_the_profile_says_it_was_priced_compiled_and_older_profiles_read_as_eager() -> None:
    model, x = _model()
    profile = trace_model(model, x, compile=True, progress=False).profile
    again = ModelProfile.from_json(profile.to_json())
    assert again.compiled and again.compile_factor == profile.compile_factor
    old = profile.to_dict()
    del old["compiled"], old["compile_factor"]  # a profile written before the field existed
    assert not ModelProfile.from_dict(old).compiled


def test_measured_times_compile_each_distinct_unit_once(monkeypatch) -> None:
    from fxpipe.tracer.measure import timing

    compiled: list[torch.nn.Module] = []

    def fake_compile(module, **kwargs):  # records what would be compiled; runs it eagerly
        compiled.append(module)
        return module

    seen: list = []
    keyed = timing.unit_structure_key

    def spy_key(runner):
        seen.append(runner)
        return keyed(runner)

    monkeypatch.setattr(timing.torch, "compile", fake_compile)
    monkeypatch.setattr(timing, "unit_structure_key", spy_key)
    model, x = _model()
    profile = trace_model(model, x, measure_times=True, compile=True, progress=False).profile
    assert profile.compiled and profile.timing == "measured" and profile.compile_factor is None
    distinct = {unit_structure_key(r) for r in seen}
    # each distinct unit once (the blocks once), and the one-op unit that gauges a compiled call
    assert len(profile.units) == len(seen) > len(distinct) == len(compiled) - 1
    # repeated units share the times of the one compiled and timed
    by_key: dict = {}
    for runner, unit in zip(seen, profile.units):
        by_key.setdefault(unit_structure_key(runner), set()).add((unit.fwd_ms, unit.bwd_ms))
    assert all(len(times) == 1 for times in by_key.values())
