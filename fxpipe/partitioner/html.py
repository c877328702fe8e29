"""``report.html``: one self-contained page (inline SVG and CSS, no scripts, no network).

It shows the units coloured by stage (a strip in execution order, wrapped into rows,
with skip edges drawn as arcs), per-stage time and memory bars against the bottleneck
and the memory limit, the baseline comparison, and the simulated schedule timeline.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from fxpipe.partitioner.cost import format_size
from fxpipe.partitioner.plan import PartitionPlan
from fxpipe.partitioner.report import module_range
from fxpipe.partitioner.schedule import Timeline
from fxpipe.tracer.profile import ModelProfile

__all__ = ["write_html_report", "render_html_report"]

_PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
            "#9c755f", "#bab0ac")
_CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:24px 0 8px}
.sub{color:#555} table{border-collapse:collapse;margin:4px 0}
td,th{padding:3px 10px;border-bottom:1px solid #ddd;text-align:right} th{background:#f4f4f4}
td.l,th.l{text-align:left} tr.best td{font-weight:600} .swatch{display:inline-block;width:10px;height:10px;
margin-right:6px;border-radius:2px} svg text{font:11px system-ui,sans-serif;fill:#333}
.kpi{display:inline-block;margin:8px 18px 0 0} .kpi b{font-size:18px;display:block}
"""


def _color(stage: int) -> str:
    return _PALETTE[stage % len(_PALETTE)]


def _graph_svg(plan: PartitionPlan, profile: ModelProfile, width: int = 1100) -> str:
    """Units in execution order as cells wrapped into rows; arcs for edges that skip ahead."""
    n = len(profile.units)
    per_row = max(1, min(n, 60))
    cell = max(6.0, (width - 20) / per_row)
    rows = (n + per_row - 1) // per_row
    row_h = 44
    pos = {}
    parts = []
    for i, u in enumerate(profile.units):
        r, c = divmod(i, per_row)
        x, y = 10 + c * cell, 18 + r * row_h
        pos[u.name] = (x + cell / 2, y)
        stage = plan.stage_of(u.name)
        tip = f"{u.name} ({u.module_path}) stage {stage}: {u.compute_ms:.3f} ms, {format_size(u.param_bytes)} params"
        parts.append(f'<rect x="{x:.1f}" y="{y}" width="{max(cell - 1, 1):.1f}" height="20" fill="{_color(stage)}">'
                     f"<title>{escape(tip)}</title></rect>")
    index = profile.unit_index
    for e in profile.edges:
        if index[e.dst] - index[e.src] > 1 and e.src in pos and e.dst in pos:
            (x1, y1), (x2, y2) = pos[e.src], pos[e.dst]
            if y1 == y2:
                parts.append(f'<path d="M{x1:.1f},{y1} Q{(x1 + x2) / 2:.1f},{y1 - 16} {x2:.1f},{y2}" '
                             'fill="none" stroke="#555" stroke-width="0.8" opacity="0.6"/>')
            else:
                parts.append(f'<line x1="{x1:.1f}" y1="{y1 + 20}" x2="{x2:.1f}" y2="{y2}" stroke="#555" '
                             'stroke-width="0.6" opacity="0.4"/>')
    height = 18 + rows * row_h
    return f'<svg width="{width}" height="{height}" role="img" aria-label="units by stage">{"".join(parts)}</svg>'


def _bars_svg(values: list[float], reference: float, labels: list[str], unit: str, limit_label: str,
              split: list[float] | None = None, width: int = 700) -> str:
    """Horizontal bars per stage, scaled to ``reference`` (drawn as a dashed line)."""
    bar_h, gap, left = 18, 6, 70
    scale_max = max(max(values, default=0.0), reference) or 1.0
    span = width - left - 150
    parts = []
    for i, v in enumerate(values):
        y = i * (bar_h + gap) + 4
        w = span * v / scale_max
        parts.append(f'<text x="4" y="{y + 13}">stage {i}</text>')
        if split is not None:
            first = span * split[i] / scale_max
            parts.append(f'<rect x="{left}" y="{y}" width="{first:.1f}" height="{bar_h}" fill="{_color(i)}"/>')
            parts.append(f'<rect x="{left + first:.1f}" y="{y}" width="{max(w - first, 0):.1f}" height="{bar_h}" '
                         f'fill="{_color(i)}" opacity="0.45"/>')
        else:
            parts.append(f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{_color(i)}"/>')
        parts.append(f'<text x="{left + w + 6:.1f}" y="{y + 13}">{escape(labels[i])}</text>')
    height = len(values) * (bar_h + gap) + 24
    x_ref = left + span * reference / scale_max
    parts.append(f'<line x1="{x_ref:.1f}" y1="0" x2="{x_ref:.1f}" y2="{height - 16}" stroke="#c00" '
                 'stroke-dasharray="4 3"/>')
    parts.append(f'<text x="{x_ref + 4:.1f}" y="{height - 4}" style="fill:#c00">{escape(limit_label)}</text>')
    return f'<svg width="{width}" height="{height}" role="img" aria-label="{escape(unit)} per stage">{"".join(parts)}</svg>'


def _timeline_svg(line: Timeline, width: int = 1100) -> str:
    """Ranks x time, coloured by stage; F boxes solid, B lighter, W lightest, labelled with the microbatch."""
    R = line.num_ranks
    lane, left = 26, 60
    scale = (width - left - 10) / (line.step_ms or 1.0)
    parts = []
    for i in range(R):
        parts.append(f'<text x="4" y="{i * lane + 17}">rank {i}</text>')
    for op in line.ops:
        x = left + op.start_ms * scale
        w = max((op.end_ms - op.start_ms) * scale, 0.5)
        y = (op.rank if op.rank >= 0 else op.stage) * lane + 2
        opacity = {"F": "1", "B": "0.6", "W": "0.3"}.get(op.kind, "1")
        parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{lane - 4}" fill="{_color(op.stage)}" '
                     f'opacity="{opacity}" stroke="#fff" stroke-width="0.5"><title>{op} {op.start_ms:.2f}-'
                     f'{op.end_ms:.2f} ms</title></rect>')
        if w > 18:
            parts.append(f'<text x="{x + 3:.1f}" y="{y + 15}" style="fill:#fff">{op.kind}{op.microbatch}</text>')
    height = R * lane + 22
    parts.append(f'<text x="{left}" y="{height - 4}">0 ms</text>')
    parts.append(f'<text x="{width - 80}" y="{height - 4}">{line.step_ms:.2f} ms</text>')
    return f'<svg width="{width}" height="{height}" role="img" aria-label="schedule timeline">{"".join(parts)}</svg>'


def render_html_report(plan: PartitionPlan, profile: ModelProfile) -> str:
    """The report page as a string (see ``write_html_report``)."""
    pred = plan.prediction
    paths = {u.name: u.module_path for u in profile.units}
    line = plan.timeline()
    ranks = plan.stage_ranks
    stage_rows = "".join(
        f'<tr><td class="l"><span class="swatch" style="background:{_color(s.index)}"></span>{s.index}</td>'
        f"<td>{ranks[s.index]}</td>"
        f'<td class="l">{escape(module_range([paths.get(u, u) for u in s.units]))}</td><td>{len(s.units)}</td>'
        f"<td>{s.compute_ms:.3f}</td><td>{s.comm_ms:.3f}</td><td>{s.stage_ms:.3f}</td>"
        f"<td>{format_size(s.memory_bytes)}</td></tr>"
        for s in plan.stages)
    lb = plan.lower_bound_ms
    base_rows = [f'<tr class="best"><td class="l">fxpipe ({escape(plan.solver)})</td><td>{plan.bottleneck_ms:.3f}</td>'
                 f"<td>{plan.bottleneck_ms / lb if lb else 1:.3f}</td><td>1.000</td>"
                 f"<td>{f'{plan.step_ms:.2f}' if pred else ''}</td>"
                 f'<td class="l">{"optimal" if plan.optimal else f"gap {plan.gap:.1%}"}</td></tr>']
    for name, b in plan.baselines.items():
        ok = "" if b.feasible else "breaks constraints"
        base_rows.append(f'<tr><td class="l">{escape(name)}</td><td>{b.bottleneck_ms:.3f}</td>'
                         f'<td>{b.bottleneck_ms / lb if lb else 1:.3f}</td>'
                         f'<td>{b.bottleneck_ms / plan.bottleneck_ms if plan.bottleneck_ms else 1:.3f}</td>'
                         f'<td>{f"{b.step_ms:.2f}" if b.step_ms is not None else ""}</td><td class="l">{ok}</td></tr>')
    base_rows.append(f'<tr><td class="l">lower bound</td><td>{lb:.3f}</td><td>1.000</td><td></td><td></td>'
                     f'<td class="l">{escape(", ".join(f"{k} {v:.3f}" for k, v in plan.lower_bounds.items()))}</td></tr>')
    times = [s.stage_ms for s in plan.stages]
    mems = [float(m) for m in plan.rank_memory_bytes] or [float(s.memory_bytes) for s in plan.stages]
    mem_ref = float(plan.memory_limit) if plan.memory_limit else max(mems)
    mem_label = f"limit {format_size(plan.memory_limit)}" if plan.memory_limit else "no limit (peak shown)"
    title = escape(profile.model.title)
    kpis = (f'<span class="kpi"><b>{plan.step_ms:.2f} ms</b>predicted step ({plan.schedule})</span>\n'
            f'<span class="kpi"><b>{pred.bubble:.1%}</b>bubble</span>\n'
            f'<span class="kpi"><b>{pred.throughput_samples_per_s:.1f}</b>samples/s</span>\n') if pred else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>fxpipe plan: {title}</title><style>{_CSS}</style></head>
<body>
<h1>fxpipe pipeline plan: {title}</h1>
<div class="sub">{plan.num_stages} stages on {plan.num_ranks} ranks, {len(profile.units)} units, solver
{escape(plan.solver)}, schedule {plan.schedule}, {plan.microbatches} microbatches of {plan.microbatch_size},
link {escape(plan.cost.link)}. {escape(plan.optimal_for)}.</div>
<div><span class="kpi"><b>{plan.bottleneck_ms:.3f} ms</b>bottleneck stage</span>
{kpis}<span class="kpi"><b>{format_size(max(mems))}</b>peak rank memory</span></div>
<h2>Units by stage (execution order)</h2>
{_graph_svg(plan, profile)}
<h2>Stages</h2>
<table><tr><th class="l">stage</th><th>rank</th><th class="l">modules</th><th>units</th><th>compute ms</th><th>comm ms</th>
<th>stage ms</th><th>memory</th></tr>{stage_rows}</table>
<h2>Stage time (compute solid, communication light) vs the bottleneck</h2>
{_bars_svg(times, plan.bottleneck_ms, [f"{t:.3f} ms" for t in times], "time", f"bottleneck {plan.bottleneck_ms:.3f} ms",
           split=[s.compute_ms for s in plan.stages])}
<h2>Rank memory vs the limit</h2>
{_bars_svg(mems, mem_ref, [format_size(m) for m in mems], "memory", mem_label)}
{_data_parallel_html(plan)}
<h2>Baselines (same cost model)</h2>
<table><tr><th class="l">strategy</th><th>bottleneck ms</th><th>x lower bound</th><th>x plan</th>
<th>step ms</th><th class="l">note</th></tr>{"".join(base_rows)}</table>
<h2>Schedule timeline ({plan.schedule}, one step; F solid, B light, W lightest)</h2>
{_timeline_svg(line)}
{_alternatives_html(plan)}
</body></html>
"""


def _alternatives_html(plan: PartitionPlan) -> str:
    """``--schedule auto``: every schedule it planned, with its own split's timeline."""
    if not plan.alternatives:
        return ""
    rows, lines = [], []
    for o in plan.alternatives:
        step = f"{o.step_ms:.2f}" if o.step_ms is not None else ""
        bubble = f"{o.bubble:.1%}" if o.bubble is not None else ""
        mem = format_size(o.peak_memory_bytes) if o.peak_memory_bytes is not None else ""
        best = ' class="best"' if o.chosen else ""
        rows.append(f'<tr{best}><td class="l">{escape(o.schedule)}</td>'
                    f"<td>{o.virtual_stages}</td><td>{step}</td><td>{bubble}</td><td>{mem}</td>"
                    f'<td class="l">{escape(o.note)}</td></tr>')
        line = o.timeline(plan.microbatches)
        if line is not None:
            lines.append(f"<h3>{escape(o.schedule)} (V={o.virtual_stages}){' — chosen' if o.chosen else ''}</h3>"
                         + _timeline_svg(line))
    return ("<h2>Schedules planned by --schedule auto (the least predicted step wins)</h2>"
            '<table><tr><th class="l">schedule</th><th>V</th><th>step ms</th><th>bubble</th><th>peak memory</th>'
            f'<th class="l">note</th></tr>{"".join(rows)}</table>' + "".join(lines))


def _data_parallel_html(plan: PartitionPlan) -> str:
    """Per stage and rank: the data-parallel traffic per step and the sharded training state (empty without replicas)."""
    cost = plan.cost
    if cost.dp_replicas <= 1:
        return ""
    rows = "".join(f"<tr><td class=\"l\">{s.index}</td><td>{s.dp_allreduce_ms:.3f}</td><td>{format_size(s.dp_bytes)}</td>"
                   f"<td>{format_size(s.memory.params)}</td><td>{format_size(s.memory.grads)}</td>"
                   f"<td>{format_size(s.memory.optimizer)}</td></tr>" for s in plan.stages)
    return (f"<h2>Data parallelism: {cost.dp_replicas} replicas, shard {escape(cost.shard)}"
            f"{f', reduce per {escape(cost.shard_reduce)}' if cost.shard in ('grad-op', 'full') else ''}</h2>\n"
            "<table><tr><th class=\"l\">stage</th><th>dp comm ms/step</th><th>sent per rank/step</th>"
            f"<th>params per rank</th><th>grads per rank</th><th>optimizer per rank</th></tr>{rows}</table>")


def write_html_report(plan: PartitionPlan, profile: ModelProfile, path: str | Path) -> Path:
    """Write the self-contained report page to ``path`` and return the path."""
    out = Path(path)
    out.write_text(render_html_report(plan, profile), encoding="utf-8")
    return out
