"""``CostModel.precision``: boundary tensors priced in the autocast dtype the runtime sends them in."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from fxpipe.errors import ConfigError
from fxpipe.partitioner import CostModel, plan_partition
from fxpipe.partitioner.problem import build_problem, evaluate
from fxpipe.tracer import trace_model


def _profile() -> object:
    model = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(4)))
    return trace_model(model, (torch.randn(32, 256),)).profile


def test_half_precision_halves_the_boundary_bytes_and_their_time() -> None:
    profile = _profile()
    fp32 = CostModel(link_bandwidth=1e8, link_latency=0.0)
    plans = {
        p: plan_partition(
            profile, 2, solver="uniform", microbatches=2, cost=replace(fp32, precision=p)
        )
        for p in ("fp32", "bf16", "fp16")
    }
    sent = {p: [s.send_bytes for s in plan.stages] for p, plan in plans.items()}
    assert (
        sent["fp32"][0] == 32 * 256 * 4
    )  # one fp32 activation (32 x 256, the traced batch) in fp32
    assert sent["bf16"] == sent["fp16"] == [b // 2 for b in sent["fp32"]]
    comm = {p: plan.stages[0].comm_ms for p, plan in plans.items()}
    assert comm["bf16"] == pytest.approx(comm["fp32"] / 2)  # no latency: time is bytes / bandwidth
    assert plans["bf16"].cost.to_dict()["precision"] == "bf16"
    assert CostModel.from_dict(plans["bf16"].cost.to_dict()) == plans["bf16"].cost


def test_the_memory_of_boundary_buffers_follows_and_compute_does_not() -> None:
    problem = build_problem(_profile(), 2, microbatches=2)
    assignment = [0] * (problem.num_units // 2) + [1] * (problem.num_units - problem.num_units // 2)
    full = evaluate(problem, assignment).stages
    half = evaluate(
        replace(problem, cost=replace(problem.cost, precision="bf16")), assignment
    ).stages
    assert [s.boundary_bytes for s in half] == [s.boundary_bytes // 2 for s in full]
    assert [s.compute_ms for s in half] == [s.compute_ms for s in full]


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(ConfigError, match="precision must be one of"):
        CostModel(precision="fp8")
