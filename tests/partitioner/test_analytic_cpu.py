"""A plan of analytic CPU unit times ranks splits but prints no step time (Note [analytic CPU estimate])."""

from __future__ import annotations

import re
from dataclasses import replace

from partition_fixtures import chain_profile
from rich.console import Console

from fxpipe.partitioner import plan_partition, print_plan_report
from fxpipe.partitioner.report.html import write_html_report
from fxpipe.partitioner.report.terminal import Measurement, compare


def _plan(timing: str, trace_device: str = "cpu"):
    profile = replace(
        chain_profile([2.0, 1.0, 3.0, 1.0, 1.0, 2.0], [10**5] * 5, prefix="blocks"),
        trace_device=trace_device,
        timing=timing,
    )
    return plan_partition(profile, 2, microbatches=4), profile


def _printed(plan, profile) -> str:
    console = Console(record=True, width=400)
    print_plan_report(plan, profile, console=console)
    return console.export_text()


def test_an_analytic_cpu_plan_prints_steps_relative_to_its_own() -> None:
    plan, profile = _plan("analytic")
    assert plan.unit_times == "cpu analytic" and not plan.predicts_time
    text = _printed(plan, profile)
    assert (
        "step (x plan)" in text and "predicted step, relative to the plan's (1f1b = 1.00)" in text
    )
    assert "does not predict time on this machine (--measure-times" in text
    assert "samples/s" not in text and not re.search(
        r"\d ms\b", text.split("predicted step, relative")[1]
    )
    assert f"{plan.step_ms:.2f}" not in text


def test_measured_or_gpu_unit_times_still_predict_time() -> None:
    for timing, device in (("measured", "cpu"), ("analytic", "cuda"), ("given", "cpu")):
        plan, profile = _plan(timing, device)
        assert plan.predicts_time, (timing, device)
        text = _printed(plan, profile)
        assert f"predicted step: 1f1b {plan.step_ms:.2f} ms" in text and "samples/s" in text


def test_the_report_compares_no_step_time_with_an_analytic_cpu_plan(tmp_path) -> None:
    plan, profile = _plan("analytic")
    run = Measurement(
        step_ms=60.0,
        peak_tensor_bytes=(),
        schedule=plan.schedule,
        microbatches=4,
        world_size=2,
        device="cpu",
        predicted_step_ms=plan.step_ms,
    )  # a run.json written before the fix
    step = compare(plan, run)[0]
    assert (
        step.ratio is None
        and step.predicted == "(none: analytic CPU unit times)"
        and not step.disagrees
    )
    html = write_html_report(plan, profile, tmp_path / "report.html").read_text()
    assert "predicted step (" not in html and "does not predict time on this machine" in html
    assert "step (x plan)" in html and "samples/s" not in html
