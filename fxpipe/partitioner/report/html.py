"""``report.html``: one self-contained page (inline CSS, no scripts, no network) that reads at any size.

Sections: the figures that matter (step, bubble, throughput, bottleneck, peak memory) and
what was assumed (link, trace device); the stages as bands of module boxes whose widths
are their time (:mod:`fxpipe.partitioner.report.unit_view`); the stage table with the terminal's
columns; memory per rank; the baselines beside the lower bound; the schedule timeline over
the predicted step (:mod:`fxpipe.partitioner.report.charts`); the prediction beside a run's
measurements when there is one; the module tree; and a legend for every term. Widths
are percentages of the window, so the page has no horizontal scroll at 800 px or at 1,400 px.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from fxpipe.partitioner.cost import format_size
from fxpipe.partitioner.report.charts import bars_html, plan_timeline_html, timeline_html
from fxpipe.partitioner.report.unit_view import (
    module_groups,
    module_tree_html,
    stage_bands_html,
    stage_color,
)
from fxpipe.partitioner.plan import PartitionPlan
from fxpipe.partitioner.report.terminal import (
    planned_for,
    DISAGREE,
    NO_TIME,
    unit_times_note,
    Measurement,
    compare,
    link_note,
    module_range,
    step_cell,
)
from fxpipe.tracer.profile import ModelProfile

__all__ = ["write_html_report", "render_html_report"]

_CSS = """
*{box-sizing:border-box} body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:16px;
color:#222;background:#fff} h1{font-size:20px;margin:0 0 4px;overflow-wrap:anywhere}
h2{font-size:16px;margin:22px 0 8px} h3{font-size:14px;margin:14px 0 6px} .sub{color:#555;overflow-wrap:anywhere}
.scroll{overflow-x:auto;max-width:100%} table{border-collapse:collapse;margin:4px 0}
td,th{padding:3px 8px;border-bottom:1px solid #ddd;text-align:right;white-space:nowrap}
th{background:#f4f4f4} td.l,th.l{text-align:left;white-space:normal;overflow-wrap:break-word}
tr.best td{font-weight:600}
tr.off td{color:#b00020;font-weight:600}
.sw{display:inline-block;width:10px;height:10px;margin-right:6px;border-radius:2px;background:var(--c)}
.kpis{display:flex;flex-wrap:wrap;gap:6px 22px;margin:10px 0} .kpi b{font-size:18px;display:block}
.lbl{overflow:hidden;white-space:nowrap;text-overflow:ellipsis}
.bands{display:flex;flex-direction:column;gap:4px}
.band{display:flex;align-items:center;gap:8px} .bh{flex:0 0 150px;font-size:11px;line-height:13px}
.band.bottleneck .bh{font-weight:600} .track{flex:1 1 auto;min-width:0}
.fill{display:flex;height:26px;max-width:100%}
.box{flex:1 1 0;min-width:0;display:block;background:var(--c);color:#fff;font-size:11px;line-height:26px;
padding:0;text-indent:3px;text-decoration:none;box-shadow:inset -1px 0 #fff}
.box:hover{filter:brightness(1.15)}
.box.comm{background:repeating-linear-gradient(45deg,#999 0 4px,#bbb 4px 8px);color:#222}
.bars{display:flex;flex-direction:column;gap:4px} .brow{display:flex;align-items:center;gap:8px}
.bname{flex:0 0 70px;font-size:12px} .bval{flex:0 0 110px;font-size:12px}
.btrack{flex:1 1 auto;min-width:0;position:relative;height:18px;background:#f4f4f4}
.bfill{position:absolute;left:0;top:0;bottom:0} .ref{position:absolute;top:-3px;bottom:-3px;border-left:2px dashed #c00}
.bcap{font-size:12px;color:#c00}
.timeline{display:flex;flex-direction:column;gap:2px} .lane{display:flex;align-items:center;gap:8px}
.lh{flex:0 0 60px;font-size:12px} .lt{flex:1 1 auto;min-width:0;position:relative;height:22px}
.op{position:absolute;top:0;bottom:0;color:#fff;font-size:10px;line-height:22px;padding:0;text-indent:2px;
box-shadow:inset -1px 0 #fff}
.op.over{background:repeating-linear-gradient(45deg,#ccc 0 4px,#e4e4e4 4px 8px);color:#333}
.axis .lt{height:16px} .tick{position:absolute;top:0;font-size:11px;color:#555}
details{margin:2px 0} details.stage>summary{font-weight:600;cursor:pointer} details.grp{margin-left:18px}
details.grp>summary{cursor:pointer;position:relative;overflow-wrap:anywhere}
.mini{display:inline-block;height:8px;max-width:120px;background:#8aa;margin-right:6px;vertical-align:middle}
td.bar{width:120px;min-width:60px} td.bar span{display:block;height:8px;background:#8aa}
dl.legend{display:grid;grid-template-columns:max-content 1fr;gap:4px 14px;margin:0} dl.legend dt{font-weight:600}
dl.legend dd{margin:0;overflow-wrap:anywhere}
"""

_LEGEND = (
    (
        "bottleneck",
        "the slowest stage's time per microbatch (forward + backward compute and its messages); "
        "the pipeline cannot run faster than one microbatch per bottleneck",
    ),
    (
        "share",
        "a stage's time as a share of the bottleneck stage (100%: the stage is the bottleneck)",
    ),
    (
        "compute ms / comm ms",
        "per microbatch: the stage's forward + backward compute, and the time of the "
        "messages it sends and receives (the link below)",
    ),
    ("stage ms", "compute + comm: what the band's length and the boxes' widths show"),
    (
        "memory",
        "the stage's predicted memory: weights, gradients, optimizer state, buffers, the activations "
        "of the microbatches in flight and the boundary tensors",
    ),
    (
        "rank peak",
        "the largest memory of the stage's rank over one step, walking the schedule's actions in order "
        "(every stage the rank holds, receive buffers included); what a memory limit bounds",
    ),
    (
        "peak memory",
        "the largest per-rank memory of a plan by the stages' formula, the same for fxpipe's plan "
        "and the baselines (the solvers' memory bound; the limit itself holds the rank peak)",
    ),
    ("lower bound", "no split of these units into this many stages can have a smaller bottleneck"),
    (
        "x bound",
        "a plan's bottleneck divided by the lower bound (1.00: as good as any split can be)",
    ),
    ("x plan", "a plan's bottleneck divided by fxpipe's plan (above 1: slower than fxpipe's)"),
    (
        "gap",
        "how far fxpipe's bottleneck may be above the best possible one (0 when proven optimal)",
    ),
    (
        "proven optimal for …",
        "what the solver proved: the bottleneck stage time is minimal; the split is then "
        "the least bottleneck among those predicted within the prediction's resolution of "
        "the least step, which is not itself proven optimal",
    ),
    (
        "step ms",
        "predicted time of one training step: the simulated schedule (F forward, B backward, W weight "
        "gradients, one box per microbatch) plus the step's overheads (optimizer step, all-reduces)",
    ),
    ("bubble", "the share of the ranks x pipeline time that the ranks sit idle"),
    (
        "link",
        "the assumed connection between ranks; it prices every message (bandwidth and latency)",
    ),
    (
        "measured / predicted",
        "a run's measurement (run.json) divided by the prediction; beyond "
        f"{DISAGREE:.2f}x either way the figure is flagged",
    ),
)


def _stage_table(plan: PartitionPlan, profile: ModelProfile) -> str:
    paths = {u.name: u.module_path for u in profile.units}
    ranks = plan.stage_ranks
    walked = plan.prediction.peak_memory_bytes if plan.prediction is not None else ()
    rows = []
    for s in plan.stages:
        share = s.stage_ms / plan.bottleneck_ms if plan.bottleneck_ms > 0 else 1.0
        best = ' class="best"' if share >= 1 - 1e-9 else ""
        rows.append(
            f'<tr{best}><td class="l"><span class="sw" style="--c:{stage_color(s.index)}"></span>{s.index}</td>'
            f'<td>{ranks[s.index]}</td><td class="l">{escape(module_range([paths.get(u, u) for u in s.units]))}</td>'
            f"<td>{len(s.units)}</td><td>{s.compute_ms:.3f}</td><td>{s.comm_ms:.3f}</td><td>{s.stage_ms:.3f}</td>"
            f"<td>{format_size(s.memory_bytes)}</td>"
            + (f"<td>{format_size(walked[ranks[s.index]])}</td>" if walked else "")
            + f"<td>{share:.0%}</td></tr>"
        )
    return (
        '<div class="scroll"><table><tr><th class="l">stage</th><th>rank</th><th class="l">modules</th>'
        "<th>units</th><th>compute ms</th><th>comm ms</th><th>stage ms</th><th>memory</th>"
        + ("<th>rank peak</th>" if walked else "")
        + "<th>share</th></tr>"
        f"{''.join(rows)}</table></div>"
    )


def _baselines_table(plan: PartitionPlan) -> str:
    lb = plan.lower_bound_ms

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}" if b > 0 else "-"

    peak = max(plan.rank_memory_bytes or tuple(s.memory_bytes for s in plan.stages))
    rows = [
        f'<tr class="best"><td class="l">fxpipe ({escape(plan.solver)})</td><td>{plan.bottleneck_ms:.3f}</td>'
        f"<td>{ratio(plan.bottleneck_ms, lb)}</td><td>1.00</td>"
        f"<td>{step_cell(plan, plan.step_ms) if plan.prediction else ''}</td><td>{format_size(peak)}</td>"
        f'<td class="l">{"proven optimal" if plan.optimal else f"gap {plan.gap:.1%}"}</td></tr>'
    ]
    for name, b in plan.baselines.items():
        note = "" if b.feasible else "breaks the constraints"
        rows.append(
            f'<tr><td class="l">{escape(name)}</td><td>{b.bottleneck_ms:.3f}</td>'
            f"<td>{ratio(b.bottleneck_ms, lb)}</td><td>{ratio(b.bottleneck_ms, plan.bottleneck_ms)}</td>"
            f"<td>{step_cell(plan, b.step_ms)}</td>"
            f"<td>{format_size(max(b.memory_bytes)) if b.memory_bytes else ''}</td>"
            f'<td class="l">{note}</td></tr>'
        )
    parts = ", ".join(f"{k} {v:.3f}" for k, v in plan.lower_bounds.items())
    rows.append(
        f'<tr><td class="l">lower bound</td><td>{lb:.3f}</td><td>1.00</td>'
        f'<td>{ratio(lb, plan.bottleneck_ms)}</td><td></td><td></td><td class="l">{escape(parts)}</td></tr>'
    )
    return (
        '<div class="scroll"><table><tr><th class="l">strategy</th><th>bottleneck ms</th><th>x bound</th>'
        f"<th>x plan</th><th>{'step ms' if plan.predicts_time else 'step (x plan)'}</th><th>peak memory</th>"
        '<th class="l">note</th></tr>'
        f"{''.join(rows)}</table></div>"
    )


def _measured_html(plan: PartitionPlan, run: Measurement | None) -> str:
    if run is None:
        return ""
    rows = []
    for c in compare(plan, run):
        ratio = f"{c.ratio:.2f}x" if c.ratio is not None else ""
        off = ' class="off"' if c.disagrees else ""
        rows.append(
            f'<tr{off}><td class="l">{escape(c.figure)}</td>'
            f"<td>{escape(c.predicted)}</td><td>{escape(c.measured)}</td>"
            f"<td>{ratio}{' (disagree)' if c.disagrees else ''}</td></tr>"
        )
    return (
        f"<h2>Prediction vs measured (run.json: {run.world_size} processes on {escape(run.device)})</h2>"
        '<div class="scroll"><table><tr><th class="l">figure</th><th>predicted</th><th>measured</th>'
        f"<th>measured / predicted</th></tr>{''.join(rows)}</table></div>"
    )


def _alternatives_html(plan: PartitionPlan) -> str:
    """``--schedule auto``: every schedule it planned, with its own split's timeline."""
    if not plan.alternatives:
        return ""
    rows, lines = [], []
    for o in plan.alternatives:
        step = step_cell(plan, o.step_ms)
        bubble = f"{o.bubble:.1%}" if o.bubble is not None else ""
        mem = format_size(o.peak_memory_bytes) if o.peak_memory_bytes is not None else ""
        best = ' class="best"' if o.chosen else ""
        rows.append(
            f'<tr{best}><td class="l">{escape(o.schedule)}</td>'
            f"<td>{o.virtual_stages}</td><td>{step}</td><td>{bubble}</td><td>{mem}</td>"
            f'<td class="l">{escape(o.note)}</td></tr>'
        )
        line = o.timeline(plan.microbatches)
        if line is not None:
            lines.append(
                f"<h3>{escape(o.schedule)} (V={o.virtual_stages}){' — chosen' if o.chosen else ''}, "
                "pipeline part</h3>" + timeline_html(line)
            )
    return (
        "<h2>Schedules planned by --schedule auto (the least predicted step wins)</h2>"
        '<div class="scroll"><table><tr><th class="l">schedule</th><th>V</th><th>step ms</th><th>bubble</th>'
        f'<th>peak memory</th><th class="l">note</th></tr>{"".join(rows)}</table></div>'
        + "".join(lines)
    )


def _data_parallel_html(plan: PartitionPlan) -> str:
    """Per stage and rank: the data-parallel traffic per step and the sharded training state (empty without replicas)."""
    cost = plan.cost
    if cost.dp_replicas <= 1:
        return ""
    rows = "".join(
        f'<tr><td class="l">{s.index}</td><td>{s.dp_allreduce_ms:.3f}</td><td>{format_size(s.dp_bytes)}</td>'
        f"<td>{format_size(s.memory.params)}</td><td>{format_size(s.memory.grads)}</td>"
        f"<td>{format_size(s.memory.optimizer)}</td></tr>"
        for s in plan.stages
    )
    return (
        f"<h2>Data parallelism: {cost.dp_replicas} replicas, shard {escape(cost.shard)}"
        f"{f', reduce per {escape(cost.shard_reduce)}' if cost.shard in ('grad-op', 'full') else ''}</h2>\n"
        '<div class="scroll"><table><tr><th class="l">stage</th><th>dp comm ms/step</th>'
        "<th>sent per rank/step</th><th>params per rank</th><th>grads per rank</th><th>optimizer per rank</th>"
        f"</tr>{rows}</table></div>"
    )


def _recomputed_html(profile: ModelProfile) -> str:
    """The buffers a model built on the meta device had recomputed on the CPU, and how (Note
    [computed buffers on meta] in ``fxpipe.tracer.construct.meta_buffers``); nothing for other models."""
    if not profile.recomputed_buffers:
        return ""
    items = "".join(f"<li>{escape(line)}</li>" for line in profile.recomputed_buffers)
    return (
        "<h2>Buffers recomputed on the CPU (the model was built on the meta device)</h2>"
        f"<ul>{items}</ul>"
    )


def render_html_report(
    plan: PartitionPlan, profile: ModelProfile, measured: Measurement | None = None
) -> str:
    """The report page as a string (see the module docstring); ``measured``: a run's figures to set beside
    the prediction."""
    pred = plan.prediction
    groups = module_groups(plan, profile)
    walked = (
        pred.peak_memory_bytes if pred is not None else ()
    )  # what the limit holds (Note [memory over time])
    mems = [float(m) for m in walked or plan.rank_memory_bytes] or [
        float(s.memory_bytes) for s in plan.stages
    ]
    mem_ref = float(plan.memory_limit) if plan.memory_limit else max(mems)
    mem_label = (
        f"memory limit {format_size(plan.memory_limit)}"
        if plan.memory_limit
        else "no limit (the peak)"
    )
    title = escape(profile.model.title)
    kpis = (
        (
            f'<span class="kpi"><b>{plan.step_ms:.2f} ms</b>predicted step ({plan.schedule})</span>'
            f'<span class="kpi"><b>{pred.bubble:.1%}</b>bubble</span>'
            f'<span class="kpi"><b>{pred.throughput_samples_per_s:.1f}</b>samples/s'
            f"{' per replica' if plan.cost.dp_replicas > 1 else ''}</span>"
        )
        if pred
        else ""
    )
    if pred and not plan.predicts_time:  # Note [analytic CPU estimate] in fxpipe.partitioner.plan
        kpis = f'<span class="kpi"><b>{pred.bubble:.1%}</b>bubble</span><span class="kpi">{escape(NO_TIME)}</span>'
    assumed = escape(link_note(plan, profile.trace_device))
    timeline_title = (
        "Schedule timeline: one predicted step"
        if pred
        else "Schedule timeline (simulated, no prediction)"
    )
    if pred and not plan.predicts_time:
        timeline_title += (
            " in the analytic CPU estimate's milliseconds (its proportions hold, not its times)"
        )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<title>fxpipe plan: {title}</title><style>{_CSS}</style></head>
<body>
<h1>fxpipe pipeline plan: {title}</h1>
<div class="sub">{plan.num_stages} stages on {plan.num_ranks} ranks, {len(profile.units)} units, solver
{escape(plan.solver)}, schedule {plan.schedule}, {plan.microbatches} microbatches of {plan.microbatch_size}{escape(planned_for(plan, profile))}.
Traced on {escape(profile.trace_device)} ({escape(profile.timing)} times); assumed {assumed}.
{escape(unit_times_note(plan))}{"." if plan.unit_times else ""}
{escape(plan.optimal_for[:1].upper() + plan.optimal_for[1:])}.</div>
<div class="kpis">{kpis}<span class="kpi"><b>{plan.bottleneck_ms:.3f} ms</b>bottleneck stage</span>
<span class="kpi"><b>{format_size(max(mems))}</b>peak rank memory</span></div>
<h2>Stages: module boxes as wide as their time, bands as long as the stage's time</h2>
{stage_bands_html(plan, groups)}
<h2>Stage table</h2>
{_stage_table(plan, profile)}
<h2>Memory per rank{" (its peak over the step's schedule walk)" if walked else ""}</h2>
{bars_html(mems, [format_size(m) for m in mems], [f"rank {i}" for i in range(len(mems))], mem_ref, mem_label)}
{_data_parallel_html(plan)}
<h2>Baselines (same cost model)</h2>
{_baselines_table(plan)}
<h2>{timeline_title} ({plan.schedule}; F solid, B light, W lightest, hatched: after the pipeline)</h2>
{plan_timeline_html(plan)}
{_measured_html(plan, measured)}
{_alternatives_html(plan)}
{_recomputed_html(profile)}
<h2>Module tree (open a stage, then a module, for its units)</h2>
{module_tree_html(plan, groups)}
<h2>Legend</h2>
<dl class="legend">{"".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in _LEGEND)}</dl>
</body></html>
"""


def write_html_report(
    plan: PartitionPlan,
    profile: ModelProfile,
    path: str | Path,
    measured: Measurement | None = None,
) -> Path:
    """Write the self-contained report page to ``path`` and return the path."""
    out = Path(path)
    out.write_text(render_html_report(plan, profile, measured), encoding="utf-8")
    return out
