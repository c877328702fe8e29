"""report.html in headless Chromium at 35, 154 and 2,000+ units, 800 and 1,400 px wide: no horizontal
overflow, no overlapping labels (element boxes measured in the page), bands as long as the stage times,
the timeline's axis equal to the predicted step. Screenshots land in the test's tmp_path."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

from report_profiles import gpt_like_profile

from fxpipe.partitioner import PartitionPlan, plan_partition
from fxpipe.partitioner.report.html import render_html_report
from fxpipe.tracer.profile import ModelProfile

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (CI installs it)"
)

# Measures the laid-out page and appends the result as JSON in <pre id="fxpipe-layout">.
_PROBE = """<script>(() => {
const W = document.documentElement.clientWidth, out = {width: W, scrollWidth: document.documentElement.scrollWidth};
const boxes = [...document.querySelectorAll('.lbl')].map(e => {const r = e.getBoundingClientRect();
  return {l: r.left, t: r.top, r: r.right, b: r.bottom, text: e.textContent.slice(0, 30)};})
  .filter(r => r.r - r.l > 0.5 && r.b - r.t > 0.5);
out.labels = boxes.length;
out.outside = boxes.filter(r => r.l < -0.5 || r.r > W + 0.5).slice(0, 5);
boxes.sort((a, b) => a.t - b.t);
const overlaps = [];
for (let i = 0; i < boxes.length && overlaps.length < 5; i++) {
  for (let j = i + 1; j < boxes.length && boxes[j].t < boxes[i].b - 0.5; j++) {
    const a = boxes[i], c = boxes[j];
    const w = Math.min(a.r, c.r) - Math.max(a.l, c.l), h = Math.min(a.b, c.b) - Math.max(a.t, c.t);
    if (w > 0.5 && h > 0.5) overlaps.push([a.text, c.text, w, h]);
  }
}
out.overlaps = overlaps;
out.bands = [...document.querySelectorAll('.band .fill')].map(e => e.getBoundingClientRect().width);
out.ticks = [...document.querySelectorAll('.ticks .tick')].map(e => e.textContent);
const pre = document.createElement('pre'); pre.id = 'fxpipe-' + 'layout';
pre.textContent = JSON.stringify(out); document.body.appendChild(pre);
})();</script>"""


@lru_cache(maxsize=None)
def _planned(num_units: int) -> tuple[PartitionPlan, ModelProfile]:
    profile = gpt_like_profile(num_units)
    stages = {35: 3, 154: 4}.get(num_units, 8)
    return plan_partition(profile, stages, microbatches=2 * stages, time_limit=2), profile


def _layout(
    num_units: int, width: int, tmp_path: Path, extra: str = ""
) -> tuple[dict, PartitionPlan]:
    plan, profile = _planned(num_units)
    page = tmp_path / f"report_{num_units}.html"
    page.write_text(
        render_html_report(plan, profile).replace("</body>", extra + _PROBE + "</body>"),
        encoding="utf-8",
    )
    shot = tmp_path / f"report_{num_units}_{width}px.png"
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
        f"--user-data-dir={tmp_path / 'chromium'}",
        f"--window-size={width},1600",
        f"--screenshot={shot}",
        "--dump-dom",
        page.resolve().as_uri(),
    ]
    proc = subprocess.run(cmd, timeout=180, capture_output=True, text=True)
    found = re.search(r'<pre id="fxpipe-layout">(.*?)</pre>', proc.stdout)
    assert found, f"the probe did not run: {proc.stderr[-2000:]}"
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads(html.unescape(found.group(1))), plan


def _check(layout: dict, plan: PartitionPlan) -> None:
    assert layout["scrollWidth"] <= layout["width"], (
        f"horizontal overflow: {layout['scrollWidth']} > {layout['width']}"
    )
    assert not layout["outside"], f"labels outside the window: {layout['outside']}"
    assert not layout["overlaps"], f"overlapping labels: {layout['overlaps']}"
    assert layout["labels"] > len(plan.stages)
    # bands as long as the stages' times: the bottleneck's is the longest, the others in proportion
    times = [s.stage_ms for s in plan.stages]
    longest = max(layout["bands"])
    for band, t in zip(layout["bands"], times):
        assert band == pytest.approx(longest * t / max(times), abs=1.5)
    assert layout["ticks"][0] == "0.00 ms" and layout["ticks"][-1] == f"{plan.step_ms:.2f} ms"


@needs_chromium
@pytest.mark.parametrize("width", [800, 1400])
@pytest.mark.parametrize("num_units", [35, 154])
def test_report_layout(num_units: int, width: int, tmp_path: Path) -> None:
    _check(*_layout(num_units, width, tmp_path))


@needs_chromium
@pytest.mark.slow
@pytest.mark.parametrize("width", [800, 1400])
def test_report_layout_at_2000_units(width: int, tmp_path: Path) -> None:
    _check(*_layout(2010, width, tmp_path))


@needs_chromium
def test_the_probe_sees_overflow_and_overlap(tmp_path: Path) -> None:
    broken = (
        '<div style="width:1200px" class="lbl">wide</div>'
        '<div style="position:relative"><span class="lbl" style="position:absolute">one</span>'
        '<span class="lbl" style="position:absolute;left:4px">two</span></div>'
    )
    layout, plan = _layout(35, 800, tmp_path, extra=broken)
    with pytest.raises(AssertionError, match="horizontal overflow"):
        _check(layout, plan)
    assert layout["outside"] and [o[:2] for o in layout["overlaps"]] == [["one", "two"]]
