"""Repeated units are counted once (counting.count_units_once), and only where that cannot change a count."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.nn as nn

import fxpipe.tracer.api as tracer_api
from fxpipe.tracer import trace_model

ROOT = Path(__file__).resolve().parents[2]


def _gpt() -> nn.Module:
    spec = importlib.util.spec_from_file_location("gpt_example", ROOT / "examples" / "gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.build_model(), module.example_inputs(4)


class Routed(nn.Module):
    """Top-1 routing: how many rows each expert multiplies depends on the data, layer by layer."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 2)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(-1)
            out = out.index_add(0, rows, expert(x[rows]))
        return out


class RoutedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Routed() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def _profiles(model: nn.Module, inputs, monkeypatch) -> tuple[list, list, int]:
    calls = []
    real = tracer_api.count_unit

    def counted(runner):
        calls.append(runner)
        return real(runner)

    monkeypatch.setattr(tracer_api, "count_unit", counted)
    once = trace_model(model, inputs, progress=False).profile
    n_once = len(calls)
    monkeypatch.setattr(  # count every unit, as before
        tracer_api, "count_units_once", lambda rs, count, progress: [count(r) for r in progress(rs)]
    )
    every = trace_model(model, inputs, progress=False).profile
    return once.units, every.units, n_once


def _same(a, b) -> None:
    assert [u.name for u in a] == [u.name for u in b]
    for x, y in zip(a, b):
        assert x == y, x.name  # every field: FLOPs, bytes, times, ops


def test_repeated_layers_are_counted_once_with_the_same_counts(monkeypatch) -> None:
    model, inputs = _gpt()
    once, every, n_once = _profiles(model, inputs, monkeypatch)
    assert n_once < len(every)  # the blocks repeat
    _same(once, every)


def test_units_whose_shapes_follow_the_data_are_counted_each(monkeypatch) -> None:
    torch.manual_seed(3)
    model = RoutedStack()
    once, every, _ = _profiles(model, (torch.randn(16, 8),), monkeypatch)
    _same(once, every)
