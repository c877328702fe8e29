"""plan.json: typed round trips, reading version 1 and the minimal plan, the runtime's predicted
step, and no NaN or infinity written or accepted."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from partition_fixtures import chain_profile
from rich.console import Console

from fxpipe.errors import ConfigError, PartitionError
from fxpipe.partitioner import (
    BaselineReport,
    CostModel,
    PartitionPlan,
    Prediction,
    RuntimeCosts,
    StageMemory,
    StepOverheads,
    parse_size,
    plan_partition,
    print_plan_report,
    render_html_report,
)
from fxpipe.partitioner.plan import PLAN_SCHEMA_VERSION


def _plan(**kw: Any) -> PartitionPlan:
    profile = chain_profile([1, 2, 3, 4, 5, 6], [1000] * 5, params=[100] * 6)
    return plan_partition(profile, 3, microbatches=4, **kw)


def test_round_trip_is_typed_and_exact(tmp_path: Path) -> None:
    plan = _plan(cost=CostModel(optimizer="adam", device_speed=(1.0, 2.0, 1.0), dp_replicas=2))
    again = PartitionPlan.from_json(plan.to_json(tmp_path / "plan.json"))
    assert again == plan
    assert json.loads(again.to_json()) == json.loads((tmp_path / "plan.json").read_text())
    assert isinstance(again.cost, CostModel) and again.cost.device_speed == (1.0, 2.0, 1.0)
    assert all(isinstance(b, BaselineReport) for b in again.baselines.values())
    assert isinstance(again.stages[0].memory, StageMemory)
    pred = again.prediction
    assert isinstance(pred, Prediction) and isinstance(pred.step_overhead_ms, StepOverheads)
    assert isinstance(pred.runtime_costs, RuntimeCosts) and pred.schedule == plan.schedule
    assert (
        pred.step_ms[plan.schedule]
        == plan.step_ms
        == pytest.approx(pred.pipeline_ms[plan.schedule] + pred.step_overhead_ms.total_ms)
    )


def test_stage_memory_is_a_typed_breakdown() -> None:
    plan = _plan(cost=CostModel(optimizer="momentum"))
    for s in plan.stages:
        assert s.memory.grads == s.memory.params == 100 * len(s.units)
        assert s.memory.optimizer == s.memory.params  # momentum: one buffer per parameter byte


def _as_version_1(plan: PartitionPlan) -> dict[str, Any]:
    """``plan`` as fxpipe wrote it before the typed prediction (schema version 1)."""
    d = json.loads(plan.to_json())
    pred = d["prediction"]
    schedule = pred.pop("schedule")
    pred.update(
        bubble=pred["bubble_by_schedule"][schedule],
        samples_per_step=pred["samples_per_step"],
        throughput_samples_per_s=plan.prediction.throughput_samples_per_s
        if plan.prediction
        else 0.0,
        peak_memory_bytes=pred["peak_memory_bytes_by_schedule"][schedule],
    )
    pred["step_overhead_ms"]["total_ms"] = (
        plan.prediction.step_overhead_ms.total_ms if plan.prediction else 0.0
    )
    d["schema_version"] = 1
    return d


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_version_1_plans_are_read(schedule: str) -> None:
    plan = _plan(schedule=schedule)
    assert PartitionPlan.from_dict(_as_version_1(plan)) == plan
    assert plan.schema_version == PLAN_SCHEMA_VERSION == 2


def test_the_documented_minimal_plan_loads_and_reports() -> None:
    minimal = {
        "stages": [
            {"units": ["u0", "u1"], "compute_ms": 3.0, "comm_ms": 0.5, "memory_bytes": 2048},
            {"units": ["u2"], "compute_ms": 3.0, "comm_ms": 0.5, "memory_bytes": 1024},
        ],
        "bottleneck_ms": 3.5,
        "lower_bound_ms": 3.0,
        "optimal": False,
        "solver": "by hand",
        "baselines": {"uniform": {"bottleneck_ms": 4.0}},
    }
    plan = PartitionPlan.from_dict(minimal)
    assert plan.num_stages == 2 and plan.stage_of("u2") == 1 and plan.prediction is None
    assert plan.gap == pytest.approx(0.5 / 3.0)
    console = Console(record=True, width=160)
    print_plan_report(plan, chain_profile([1, 1, 1]), console=console)
    assert "no predicted step" in console.export_text()
    assert "by hand" in render_html_report(plan, chain_profile([1, 1, 1]))
    with pytest.raises(PartitionError, match="carries no prediction"):
        _ = plan.step_ms


@pytest.mark.parametrize(
    ("ask", "answers"),
    [
        ({}, True),
        ({"microbatches": 8}, False),  # priced for 4 microbatches
        ({"dp_replicas": 1}, False),  # priced with 2 replicas
        ({"comm_hook": "fp16"}, False),
        ({"powersgd_rank": 2}, False),
        ({"schedule": "gpipe"}, True),  # both schedules are predicted
        ({"schedule": "zbv"}, False),
    ],
)
def test_predicted_step_only_for_the_configuration_it_was_priced_for(
    ask: dict[str, Any], answers: bool
) -> None:
    plan = _plan(cost=CostModel(dp_replicas=2, comm_hook="powersgd", powersgd_rank=1))
    query: dict[str, Any] = {
        "schedule": "1f1b",
        "microbatches": 4,
        "dp_replicas": 2,
        "comm_hook": "powersgd",
        "powersgd_rank": 1,
        **ask,
    }
    got = plan.predicted_step_ms(query.pop("schedule"), **query)
    assert plan.prediction is not None
    assert got == (plan.prediction.step_ms[ask.get("schedule", "1f1b")] if answers else None)


def test_predicted_step_without_data_parallelism_ignores_the_hook() -> None:
    plan = _plan()
    assert plan.predicted_step_ms("1f1b", microbatches=4, comm_hook="fp16") == plan.step_ms


def test_nan_and_infinity_are_never_written() -> None:
    plan = _plan()
    with pytest.raises(PartitionError, match=r"^plan bottleneck_ms is not a finite number"):
        replace(plan, bottleneck_ms=math.nan).to_json()
    assert plan.prediction is not None
    broken = replace(
        plan, prediction=replace(plan.prediction, step_ms={"gpipe": math.inf, "1f1b": 1.0})
    )
    with pytest.raises(PartitionError, match=r"prediction.step_ms.gpipe is not a finite number"):
        broken.to_json()


@pytest.mark.parametrize(
    "bad",
    [
        {"link_bandwidth": math.inf},
        {"link_bandwidth": math.nan},
        {"link_latency": math.inf},
        {"link_latency": math.nan},
        {"device_speed": (1.0, math.inf)},
        {"device_speed": (math.nan,)},
        {"device_speed": ("fast",)},
    ],
)
def test_cost_model_refuses_non_finite_inputs(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="must be a (finite )?number"):
        CostModel(**bad)


@pytest.mark.parametrize("bad", ["1e999GB", math.inf, math.nan])
def test_sizes_must_be_finite(bad: Any) -> None:
    with pytest.raises(ConfigError):
        parse_size(bad)


@pytest.mark.parametrize("limit", [math.nan, math.inf, 0, -1])
def test_time_limit_must_be_finite_and_positive(limit: float) -> None:
    with pytest.raises(PartitionError, match="time_limit must be a finite number of seconds > 0"):
        plan_partition(chain_profile([1, 1]), 2, time_limit=limit)


def test_prediction_must_cover_its_schedule() -> None:
    with pytest.raises(PartitionError, match="no entry for its schedule '1f1b'"):
        Prediction(
            schedule="1f1b",
            step_ms={"gpipe": 1.0},
            pipeline_ms={"gpipe": 1.0},
            bubble_by_schedule={"gpipe": 0.0},
            peak_memory_bytes_by_schedule={"gpipe": (1,)},
            step_overhead_ms=StepOverheads(),
            runtime_costs=RuntimeCosts(),
            samples_per_step=1,
        )
