"""Terminal report of a plan (rich tables): stages, baselines beside the bound, prediction, and the
prediction beside what a run measured (``run.json``), with the ratio where they disagree."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from fxpipe.partitioner.cost import default_link, format_size
from fxpipe.partitioner.plan import PartitionPlan
from fxpipe.tracer.measure.calibration import DEVICE_PRESETS
from fxpipe.partitioner.seqlen import priced_lengths
from fxpipe.tracer.profile import ModelProfile

__all__ = [
    "print_plan_report",
    "module_range",
    "Measurement",
    "Comparison",
    "compare",
    "link_note",
    "print_measurement",
    "DISAGREE",
    "NO_TIME",
    "step_cell",
    "unit_times_note",
]

DISAGREE = 1.25  # measured / predicted outside [1/DISAGREE, DISAGREE]: the report flags the figure
NO_TIME = (
    "no step time or throughput: the unit times are an analytic estimate for the CPU, which ranks splits and "
    "schedules but does not predict time on this machine (--measure-times times the units here)"
)


@dataclass(frozen=True)
class Measurement:
    """What a run measured (``fxpipe run`` writes it as ``run.json``), in the plan's terms.

    ``predicted_step_ms`` is the plan's prediction for the run's own configuration, ``None``
    when the plan was made for another (then no step figure is comparable)."""

    step_ms: float
    peak_tensor_bytes: tuple[int, ...]
    schedule: str
    microbatches: int
    world_size: int
    device: str
    predicted_step_ms: float | None


@dataclass(frozen=True)
class Comparison:
    """One figure predicted and measured; ``ratio`` = measured / predicted (``None``: not comparable)."""

    figure: str
    predicted: str
    measured: str
    ratio: float | None

    @property
    def disagrees(self) -> bool:
        return self.ratio is not None and not (1 / DISAGREE <= self.ratio <= DISAGREE)


def compare(plan: PartitionPlan, run: Measurement) -> list[Comparison]:
    """The step time and each rank's peak tensor memory, predicted beside measured."""
    out = []
    pred = run.predicted_step_ms if plan.predicts_time else None
    why = "(planned for another run)" if plan.predicts_time else "(none: analytic CPU unit times)"
    out.append(
        Comparison(
            f"step ms ({run.schedule}, {run.microbatches} microbatches)",
            f"{pred:.2f}" if pred is not None else why,
            f"{run.step_ms:.2f}",
            run.step_ms / pred if pred else None,
        )
    )
    peaks = plan.prediction.peak_memory_bytes if plan.prediction is not None else ()
    same = run.schedule == plan.schedule and run.microbatches == plan.microbatches
    for rank, measured in enumerate(run.peak_tensor_bytes):
        predicted = (
            peaks[rank]
            if same and rank < len(peaks) and len(run.peak_tensor_bytes) == len(peaks)
            else None
        )
        out.append(
            Comparison(
                f"rank {rank} peak tensor memory",
                format_size(predicted) if predicted is not None else "",
                format_size(measured),
                measured / predicted if predicted else None,
            )
        )
    return out


def link_note(plan: PartitionPlan, trace_device: str) -> str:
    """Which link the plan assumed, and whether that was the default for the trace device."""
    cost = plan.cost
    figures = f"{cost.link_bandwidth / 1e9:.3g} GB/s, {cost.link_latency * 1e6:.3g} µs per message"
    if (
        cost.node_size > 0 or cost.inter_link_bandwidth is not None
    ):  # a cluster search's plan (Note [cluster links])
        inter = ""
        if cost.inter_link_bandwidth is not None:
            inter = (
                f", {cost.inter_link_bandwidth / 1e9:.3g} GB/s and "
                f"{(cost.inter_link_latency or 0.0) * 1e6:.3g} µs between nodes of {cost.node_size}"
            )
        return (
            f"link {cost.link} ({figures}) inside a node{inter}: the cluster's --intra-link / --inter-link "
            f"(presets, or --*-bandwidth / --*-latency)"
        )
    default = default_link(trace_device)
    why = (
        f"the default for a {trace_device} trace; --link to change"
        if cost.link == default
        else f"chosen with --link; the default for a {trace_device} trace is {default}"
    )
    return f"link {cost.link} ({figures}), {why}"


def print_measurement(plan: PartitionPlan, run: Measurement, console: Console) -> None:
    """The prediction beside ``run.json``, the ratio, and a flag on figures that disagree."""
    table = Table(
        title=f"prediction vs measured (run.json: {run.world_size} processes on {run.device})",
        title_justify="left",
    )
    for col in ("figure", "predicted", "measured", "measured / predicted"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    rows = compare(plan, run)
    for row in rows:
        ratio = f"{row.ratio:.2f}x" if row.ratio is not None else ""
        table.add_row(
            row.figure,
            row.predicted,
            row.measured,
            ratio + (" (disagree)" if row.disagrees else ""),
            style="bold red" if row.disagrees else "",
        )
    console.print(table)
    if any(r.disagrees for r in rows):
        console.print(
            f"the prediction and the run disagree by more than {DISAGREE:.2f}x on the figures in red: "
            "the cost model's link and device presets may not match this machine (--link, "
            "--measure-times)"
        )


def unit_times_note(plan: PartitionPlan) -> str:
    """What the plan's unit times are, eager or compiled, and so which stages the plan is for
    (``fxpipe run`` with or without ``--compile``; Note [compiled unit times] in
    :mod:`fxpipe.tracer.measure.timing`). ``""`` for a plan that does not record its unit times."""
    if not plan.unit_times:
        return ""
    if not plan.compiled:
        return f"unit times: {plan.unit_times}, eager: a plan for eager stages (fxpipe run without --compile)"
    if plan.compile_factor is None:
        how = f"{plan.unit_times}, each unit under torch.compile"
    else:
        preset = DEVICE_PRESETS.get(plan.unit_times.split()[0])
        source = (
            "calibration.json's factor"
            if preset is not None and plan.compile_factor == preset.compile_factor
            else "--compile-factor"
        )
        how = f"{plan.unit_times} x {plan.compile_factor:.2f} compiled-kernel factor ({source})"
    return f"unit times: {how}: a plan for compiled stages (fxpipe run --compile)"


def module_range(paths: list[str]) -> str:
    """``['blocks.3', 'blocks.4', 'blocks.6.mlp']`` -> ``'blocks.3 … blocks.6.mlp'``."""
    named = [p for p in paths if p] or ["(root)"]
    return named[0] if len(named) == 1 or named[0] == named[-1] else f"{named[0]} … {named[-1]}"


def planned_for(plan: PartitionPlan, profile: ModelProfile) -> str:
    """The length(s) the plan was priced at, and the range the build runs (Note [pricing at a length]
    in :mod:`fxpipe.partitioner.seqlen`); "" without dynamic dimensions besides the batch."""
    lengths = plan.priced_at or priced_lengths(profile)
    if not lengths:
        return ""
    runs = (
        profile.dynamic[0].shown()
        if len(profile.dynamic) == 1
        else ", ".join(f"{r.name} {r.shown()}" for r in profile.dynamic)
    )
    if len(lengths) == 1:
        at = f"priced at {lengths[0].shown()}"
    else:
        shown = ", ".join(f"{p.shown()} ({p.weight:.0%})" for p in lengths)
        at = f"priced at the expected step over {shown}, memory at the longest"
    return f", {at}" + (f" (the build runs {runs})" if runs else "")


def print_plan_report(
    plan: PartitionPlan, profile: ModelProfile, console: Console | None = None
) -> None:
    """Print one row per stage, the baselines next to the lower bound, and the predicted
    step time, bubble and throughput."""
    console = console or Console()
    paths = {u.name: u.module_path for u in profile.units}
    limit = plan.memory_limit
    placed = (
        ""
        if plan.virtual_stages == 1
        else f" on {plan.num_ranks} ranks ({plan.placement} placement)"
    )
    title = (
        f"{plan.num_stages}-stage plan{placed} ({plan.solver}), "
        f"{plan.schedule}, {plan.microbatches} microbatches"
        + (f", memory limit {format_size(limit)}" if limit else "")
        + (
            f", {plan.cost.dp_replicas} replicas (shard {plan.cost.shard}; memory per rank)"
            if plan.cost.dp_replicas > 1
            else ""
        )
        + planned_for(plan, profile)
    )
    table = Table(title=title, title_justify="left")
    dp = any(
        s.dp_allreduce_ms > 0 for s in plan.stages
    )  # data-parallel replicas: show the per-step all-reduce
    columns = [
        ("stage", "right"),
        ("rank", "right"),
        ("modules", "left"),
        ("units", "right"),
        ("compute ms", "right"),
        ("comm ms", "right"),
        ("stage ms", "right"),
        ("memory", "right"),
        ("share", "right"),
    ]
    walked = plan.prediction.peak_memory_bytes if plan.prediction is not None else ()
    if (
        walked
    ):  # what a memory limit bounds (Note [memory over time]); "memory" is the stage's own formula
        columns.insert(8, ("rank peak", "right"))
    if dp:
        columns.insert(
            7, ("dp all-reduce ms" if plan.cost.shard == "none" else "dp comm ms", "right")
        )
        columns.insert(8, ("dp sent/step", "right"))
    for col, justify in columns:
        table.add_column(
            col,
            justify=justify,  # type: ignore[arg-type]
            no_wrap=col != "modules",
            min_width=18 if col == "modules" else None,
        )
    for s in plan.stages:
        share = s.stage_ms / plan.bottleneck_ms if plan.bottleneck_ms > 0 else 1.0
        mem = format_size(s.memory_bytes)
        style = "bold" if share >= 1 - 1e-9 else ""
        cells = [
            str(s.index),
            str(plan.stage_ranks[s.index]),
            module_range([paths.get(u, u) for u in s.units]),
            str(len(s.units)),
            f"{s.compute_ms:.3f}",
            f"{s.comm_ms:.3f}",
            f"{s.stage_ms:.3f}",
            mem,
            f"{share:.0%}",
        ]
        if walked:
            cells.insert(8, format_size(walked[plan.stage_ranks[s.index]]))
        if dp:
            cells.insert(7, f"{s.dp_allreduce_ms:.3f}")
            cells.insert(8, format_size(s.dp_bytes))
        table.add_row(*cells, style=style)
    console.print(table)

    cmp = Table(title="bottleneck vs baselines and the lower bound", title_justify="left")
    step_col = "step ms" if plan.predicts_time else "step (x plan)"  # Note [analytic CPU estimate]
    for col in ("strategy", "bottleneck ms", "x bound", "x plan", step_col, "peak memory", "note"):
        cmp.add_column(
            col,
            justify="left" if col in ("strategy", "note") else "right",
            no_wrap=col != "note",
            min_width=11 if col == "note" else None,
        )
    lb = plan.lower_bound_ms
    pred = plan.prediction
    peak = max(plan.rank_memory_bytes or tuple(s.memory_bytes for s in plan.stages))
    cmp.add_row(
        f"fxpipe ({plan.solver})",
        f"{plan.bottleneck_ms:.3f}",
        _ratio(plan.bottleneck_ms, lb),
        "1.00",
        step_cell(plan, plan.step_ms) if pred else "",
        format_size(peak),
        "optimal" if plan.optimal else f"gap {plan.gap:.1%}",
        style="bold",
    )
    for name, b in plan.baselines.items():
        cmp.add_row(
            name,
            f"{b.bottleneck_ms:.3f}",
            _ratio(b.bottleneck_ms, lb),
            _ratio(b.bottleneck_ms, plan.bottleneck_ms),
            step_cell(plan, b.step_ms),
            format_size(max(b.memory_bytes)) if b.memory_bytes else "",
            _violation_note(b.violations),
        )
    cmp.add_row(
        "lower bound",
        f"{lb:.3f}",
        "1.00",
        _ratio(lb, plan.bottleneck_ms),
        "",
        "",
        max(plan.lower_bounds, key=plan.lower_bounds.__getitem__, default=""),
    )
    console.print(cmp)

    if pred is None:
        console.print(
            f"no predicted step (a hand-written plan); solved in {plan.solve_seconds:.2f} s"
            + (f"; {plan.status}" if plan.status else "")
        )
        return
    _print_alternatives(plan, console)
    console.print(f"optimal for: {plan.optimal_for}")
    console.print(f"assumed: {link_note(plan, profile.trace_device)}")
    if note := unit_times_note(plan):
        console.print(note)
    if (
        pred.runtime_costs.host_slowdown != 1.0
    ):  # Note [host speed] in fxpipe.tracer.measure.calibration
        console.print(
            f"the runtime's fixed costs are priced at the traced host's speed: "
            f"{pred.runtime_costs.host_slowdown:.2f}x the time they take on the calibration host"
        )
    if not plan.predicts_time:
        steps = ", ".join(f"{k} {v / plan.step_ms:.2f}" for k, v in pred.step_ms.items())
        console.print(
            f"predicted step, relative to the plan's ({plan.schedule} = 1.00): {steps}; bubble "
            f"{pred.bubble:.1%} ({plan.schedule}); {NO_TIME}; solved in {plan.solve_seconds:.2f} s"
            + (f"; {plan.status}" if plan.status else "")
        )
        return
    steps = ", ".join(f"{k} {v:.2f} ms" for k, v in pred.step_ms.items())
    replicas = plan.cost.dp_replicas
    throughput = (
        f"throughput {pred.throughput_samples_per_s:.1f} samples/s ({pred.samples_per_step} samples per step)"
        if replicas == 1
        else f"throughput {pred.throughput_samples_per_s * replicas:.1f} samples/s for the job "
        f"({pred.samples_per_step * replicas} samples per step), {pred.throughput_samples_per_s:.1f} "
        f"per replica ({pred.samples_per_step} samples each)"
    )
    console.print(
        f"predicted step: {steps}; bubble {pred.bubble:.1%} ({plan.schedule}); {throughput}; "
        f"solved in {plan.solve_seconds:.2f} s" + (f"; {plan.status}" if plan.status else "")
    )


def _print_alternatives(plan: PartitionPlan, console: Console) -> None:
    """``--schedule auto``: one row per schedule it planned (each on its own split)."""
    if not plan.alternatives:
        return
    table = Table(
        title="schedules planned by --schedule auto (least predicted step wins)",
        title_justify="left",
    )
    for col in (
        "schedule",
        "V",
        "step ms" if plan.predicts_time else "step (x plan)",
        "bubble",
        "peak memory",
        "note",
    ):
        table.add_column(col, justify="left" if col in ("schedule", "note") else "right")
    for o in plan.alternatives:
        table.add_row(
            o.schedule + (" (chosen)" if o.chosen else ""),
            str(o.virtual_stages),
            step_cell(plan, o.step_ms),
            f"{o.bubble:.1%}" if o.bubble is not None else "",
            format_size(o.peak_memory_bytes) if o.peak_memory_bytes is not None else "",
            o.note,
            style="bold" if o.chosen else "",
        )
    console.print(table)


def step_cell(plan: PartitionPlan, step_ms: float | None) -> str:
    """A predicted step in a table: milliseconds, or relative to the plan's step where the plan predicts
    no time (Note [analytic CPU estimate] in ``fxpipe.partitioner.plan``)."""
    if step_ms is None:
        return ""
    if plan.predicts_time:
        return f"{step_ms:.2f}"
    return f"{step_ms / plan.step_ms:.2f}" if plan.step_ms > 0 else ""


def _violation_note(violations: tuple[str, ...]) -> str:
    kinds = []
    if any("limit" in v for v in violations):
        kinds.append("over memory")
    if any("pinned" in v for v in violations):
        kinds.append("breaks pins")
    return ", ".join(kinds)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "-"
