"""Terminal and HTML reports: content, self-containment, and a headless Chromium render."""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest
from partition_fixtures import chain_profile, random_dag
from rich.console import Console

from fxpipe.partitioner import plan_partition, print_plan_report, write_html_report
from fxpipe.partitioner.cost import format_size

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _plan_and_profile():
    profile = chain_profile(
        [2.0, 1.0, 3.0, 1.0, 1.0, 2.0, 4.0, 1.0],
        [10**6] * 7,
        params=[1000] * 8,
        activations=[500] * 8,
        prefix="blocks",
    )
    return plan_partition(profile, 3, microbatches=4, memory_limit=2 * 10**7), profile


def test_terminal_report_lists_stages_baselines_and_prediction() -> None:
    plan, profile = _plan_and_profile()
    console = Console(record=True, width=160)
    print_plan_report(plan, profile, console=console)
    text = console.export_text()
    first = plan.stages[0].units
    assert f"blocks.{first[0][1:]} … blocks.{first[-1][1:]}" in text or len(first) == 1
    for word in ("uniform", "params", "greedy", "lower bound", "bubble", "samples/s"):
        assert word in text


def test_stage_tables_show_each_rank_s_walked_peak(tmp_path: Path) -> None:
    # the memory limit holds the schedule walk's rank peak, not the stage formula: both tables show it
    plan, profile = _plan_and_profile()
    walked = plan.prediction.peak_memory_bytes
    assert walked and tuple(walked) != tuple(s.memory_bytes for s in plan.stages)
    console = Console(record=True, width=200)
    print_plan_report(plan, profile, console=console)
    text = console.export_text()
    assert "rank peak" in text
    table = text.split("bottleneck vs baselines")[0]
    header = next(line for line in table.splitlines() if "rank peak" in line)
    column = [c.strip() for c in header.split("┃")].index("rank peak")
    rows = [
        [c.strip() for c in line.split("│")] for line in table.splitlines() if line.startswith("│")
    ]
    assert [row[column] for row in rows] == [format_size(walked[r]) for r in plan.stage_ranks]
    html = write_html_report(plan, profile, tmp_path / "report.html").read_text()
    table = html.split("<h2>Stage table</h2>")[1].split("</table>")[0]
    assert "<th>rank peak</th>" in table
    rows = table.split("<tr")[2:]  # past the header
    assert [r.split("<td>")[-2].split("</td>")[0] for r in rows] == [
        format_size(walked[r]) for r in plan.stage_ranks
    ]
    assert (
        f"<b>{format_size(max(walked))}</b>peak rank memory" in html
    )  # the chart and its headline: the walk


def test_html_is_self_contained(tmp_path: Path) -> None:
    plan, profile = _plan_and_profile()
    html = write_html_report(plan, profile, tmp_path / "report.html").read_text()
    assert "<script" not in html and "http://" not in html and "https://" not in html
    assert (
        "<svg" not in html and 'width="1100"' not in html
    )  # percent widths: the page follows the window
    assert all(f"{op}" in html for op in ("F0", "B3"))  # the timeline labels every microbatch
    # the terminal's columns and a legend entry for every term the page uses
    for term in (
        "peak memory",
        "share",
        "x bound",
        "x plan",
        "lower bound",
        "proven optimal for",
        "bubble",
        "link loopback",
    ):
        assert term in html, term
    assert (
        "<details" in html and 'href="#m0-0"' in html and 'id="m0-0"' in html
    )  # boxes open to their units


def test_html_groups_units_by_module_tree() -> None:
    from report_profiles import gpt_like_profile

    from fxpipe.partitioner.report.unit_view import module_groups

    profile = gpt_like_profile(154)
    plan = plan_partition(profile, 4, microbatches=8, time_limit=2)
    groups = [g for stage in module_groups(plan, profile) for g in stage]
    # 'h' holds most of the time, so it opens into its blocks; a block and lm_head stay whole
    assert {g.path for g in groups} == {
        "wte",
        "wpe",
        "ln_f",
        "lm_head",
        *(f"h.{i}" for i in range(13)),
    }
    assert sum(len(g.units) for g in groups) == 154
    head = next(g for g in groups if g.path == "lm_head")
    assert head.ms == max(g.ms for g in groups)  # the heaviest module is the widest box


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (CI installs it)")
def test_html_renders_in_headless_chromium(tmp_path: Path) -> None:
    profile = random_dag(random.Random(3), 40)
    plan = plan_partition(profile, 4, microbatches=6, time_limit=2)
    page = write_html_report(plan, profile, tmp_path / "report.html")
    shot = tmp_path / "shot.png"
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=1200,1400",
        f"--screenshot={shot}",
        page.resolve().as_uri(),
    ]
    subprocess.run(cmd, check=True, timeout=120, capture_output=True)
    data = shot.read_bytes()
    assert (
        data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    )  # a blank page compresses far smaller
