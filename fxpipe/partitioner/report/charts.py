"""The report's charts as HTML boxes sized in percent: bars per rank and the schedule timeline.

Percent widths make the charts follow the window (no fixed-width SVG); every label sits in
its own column or inside its box, clipped to it, so labels never overlap or overflow.
The timeline's axis is the predicted step: the simulated pipeline part (scaled to the
prediction's pipeline time, which adds the runtime's per-action costs) and, after it,
the step's overheads (optimizer step, all-reduces, loss broadcast, fixed costs).
"""

from __future__ import annotations

from html import escape

from fxpipe.partitioner.report.unit_view import stage_color
from fxpipe.partitioner.plan import PartitionPlan
from fxpipe.partitioner.schedule import Timeline

__all__ = ["bars_html", "timeline_html"]


def bars_html(
    values: list[float], labels: list[str], names: list[str], reference: float, reference_label: str
) -> str:
    """One bar per row, scaled to ``max(values, reference)``, with a dashed line at ``reference``."""
    top = max(max(values, default=0.0), reference) or 1.0
    ref = 100 * reference / top
    rows = "".join(
        f'<div class="brow"><span class="bname lbl">{escape(name)}</span><span class="btrack">'
        f'<span class="bfill" style="width:{100 * v / top:.3f}%;background:{stage_color(i)}"></span>'
        f'<span class="ref" style="left:{ref:.3f}%"></span></span><span class="bval lbl">{escape(label)}</span></div>'
        for i, (v, label, name) in enumerate(zip(values, labels, names))
    )
    return f'<div class="bars">{rows}<div class="bcap lbl">dashed line: {escape(reference_label)}</div></div>'


def timeline_html(
    line: Timeline,
    *,
    step_ms: float | None = None,
    pipeline_ms: float | None = None,
    overheads: list[tuple[str, float]] | None = None,
) -> str:
    """Ranks x time over an axis of ``step_ms`` (default the timeline's own end): F solid, B lighter,
    W lightest, each labelled with its microbatch when it has room; then the step's overheads."""
    simulated = line.step_ms or 1.0
    pipeline = pipeline_ms if pipeline_ms else simulated
    axis = max(step_ms or pipeline, pipeline) or 1.0
    scale = pipeline / simulated  # simulated -> predicted pipeline time
    lanes: list[list[str]] = [[] for _ in range(line.num_ranks)]
    for op in line.ops:
        rank = op.rank if op.rank >= 0 else op.stage
        left = 100 * op.start_ms * scale / axis
        width = 100 * (op.end_ms - op.start_ms) * scale / axis
        opacity = {"F": "1", "B": "0.6", "W": "0.35"}.get(op.kind, "1")
        lanes[rank].append(
            f'<span class="op lbl" style="left:{left:.4f}%;width:{width:.4f}%;background:{stage_color(op.stage)};'
            f'opacity:{opacity}" title="{escape(str(op))}: {op.start_ms * scale:.2f}-{op.end_ms * scale:.2f} ms">'
            f"{op.kind}{op.microbatch}</span>"
        )
    over = sum(ms for _, ms in overheads or ())
    if over > 0:
        what = ", ".join(f"{name} {ms:.2f} ms" for name, ms in overheads or () if ms > 0)
        for lane in lanes:
            lane.append(
                f'<span class="op over lbl" style="left:{100 * pipeline / axis:.4f}%;'
                f'width:{100 * min(over, axis - pipeline) / axis:.4f}%" title="after the pipeline: '
                f'{escape(what)}">step</span>'
            )
    rows = "".join(
        f'<div class="lane"><span class="lh lbl">rank {r}</span><span class="lt">{"".join(ops)}</span></div>'
        for r, ops in enumerate(lanes)
    )
    ticks = "".join(
        f'<span class="tick lbl" style="left:{100 * f:.1f}%{";transform:translateX(-100%)" if f == 1 else ""}'
        f'{";transform:translateX(-50%)" if 0 < f < 1 else ""}">{f * axis:.2f} ms</span>'
        for f in (0.0, 0.25, 0.5, 0.75, 1.0)
    )
    return (
        f'<div class="timeline" role="img" aria-label="schedule timeline">{rows}'
        f'<div class="lane axis"><span class="lh"></span><span class="lt ticks">{ticks}</span></div></div>'
    )


def plan_timeline_html(plan: PartitionPlan) -> str:
    """The plan's own timeline over its predicted step (the simulated part alone without a prediction)."""
    pred = plan.prediction
    line = plan.timeline()
    if pred is None:
        return timeline_html(line)
    o = pred.step_overhead_ms
    overheads = [
        ("optimizer", o.optimizer_ms),
        ("data-parallel", o.dp_all_reduce_ms),
        ("tied all-reduce", o.tied_all_reduce_ms),
        ("loss broadcast", o.loss_broadcast_ms),
        ("fixed", o.fixed_ms),
    ]
    return timeline_html(
        line, step_ms=plan.step_ms, pipeline_ms=pred.pipeline_ms[plan.schedule], overheads=overheads
    )
