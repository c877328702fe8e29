"""Unit costs (analytic and measured), JSON round trip, the networkx view and the table."""

from __future__ import annotations

import io

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
    return trace_model(model, x, progress=False), trace_model(model, x, measure_times=True, progress=False)


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
    # Linear saves its input for the weight gradient: 64x512 floats
    assert units["small"].activation_bytes >= 64 * 512 * 4
    assert units["big"].outputs[0].nbytes == 64 * 512 * 4
    edge = both_modes[0].profile.edges[0]
    assert edge.bytes == 64 * 512 * 4


def test_analytic_mode_is_deterministic():
    x = (torch.randn(8, 512),)
    a = trace_model(_BigSmall(), x, progress=False).profile
    b = trace_model(_BigSmall(), x, progress=False).profile
    assert [(u.fwd_ms, u.bwd_ms, u.activation_bytes) for u in a.units] == \
        [(u.fwd_ms, u.bwd_ms, u.activation_bytes) for u in b.units]


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
