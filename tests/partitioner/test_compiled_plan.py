"""A plan says whether it was priced for compiled stages, and `fxpipe run` says when it runs the
other mode (Note [compiled unit times] in fxpipe.tracer.measure.timing)."""

from __future__ import annotations

from dataclasses import replace

from partition_fixtures import chain_profile
from rich.console import Console

from fxpipe.partitioner import plan_partition, print_plan_report
from fxpipe.partitioner.plan import PartitionPlan
from fxpipe.partitioner.report.html import write_html_report
from fxpipe.runtime.train.loop import plan_mode_note
from fxpipe.tracer.measure.calibration import DEVICE_PRESETS


def _plan(**fields):
    profile = replace(
        chain_profile([2.0, 1.0, 3.0, 1.0, 1.0, 2.0], [10**5] * 5, prefix="blocks"),
        trace_device="cpu",
        **fields,
    )
    return plan_partition(profile, 2, microbatches=4), profile


def _printed(plan, profile) -> str:
    console = Console(record=True, width=400)
    print_plan_report(plan, profile, console=console)
    return console.export_text()


def test_the_report_says_the_plan_is_for_compiled_or_eager_stages(tmp_path) -> None:
    eager, profile = _plan(timing="measured")
    assert not eager.compiled
    assert "unit times: cpu measured, eager: a plan for eager stages" in _printed(eager, profile)
    timed, profile = _plan(timing="measured", compiled=True)
    assert timed.compiled and timed.compile_factor is None
    text = _printed(timed, profile)
    assert (
        "unit times: cpu measured, each unit under torch.compile: a plan for compiled stages"
        in text
    )
    factor = DEVICE_PRESETS["cpu"].compile_factor
    scaled, profile = _plan(timing="analytic", compiled=True, compile_factor=factor)
    assert (
        f"unit times: cpu analytic x {factor:.2f} compiled-kernel factor "
        "(calibration.json's factor): a plan for compiled stages" in _printed(scaled, profile)
    )
    given, profile = _plan(timing="analytic", compiled=True, compile_factor=0.5)
    assert "x 0.50 compiled-kernel factor (--compile-factor)" in _printed(given, profile)
    html = write_html_report(given, profile, tmp_path / "plan.html").read_text()
    assert "a plan for compiled stages" in html
    again = PartitionPlan.from_json(given.to_json())
    assert again.compiled and again.compile_factor == 0.5


def test_run_says_one_line_when_the_plan_was_priced_for_the_other_mode() -> None:
    eager, _ = _plan(timing="measured")
    compiled, _ = _plan(timing="measured", compiled=True)
    assert plan_mode_note(eager, False) == plan_mode_note(compiled, True) == ""
    assert plan_mode_note(None, True) == ""
    said = plan_mode_note(eager, True)
    assert "priced for eager stages and this run compiles them" in said and "\n" not in said
    said = plan_mode_note(compiled, False)
    assert "priced for compiled stages and this run is eager" in said and "\n" not in said
