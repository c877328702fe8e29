"""The report's unit view: stage bands of module boxes (widths proportional to time) and the module tree.

Units are grouped by the module tree: a module that holds more than ``_EXPAND_SHARE`` of
the model's time (and has several children) is opened into its children, so GPT-2 shows
``wte``, ``h.0`` … ``h.11``, ``ln_f`` and ``lm_head``, not 150 units or one ``h``. Each
stage is one band whose length is its time against the bottleneck stage; its boxes are
its module groups in execution order (at most ``_MAX_BOXES`` per band: neighbours merge
into ranges beyond that) and its communication, each as wide as its share of the time.
Every box links to its module in the tree below (a ``<details>`` per stage and per
module that opens to a table of its units; following a link opens it). Labels are
clipped to their box, so they never overlap, at any width and any size of model.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape

from fxpipe.partitioner.cost import format_size
from fxpipe.partitioner.plan import PartitionPlan
from fxpipe.partitioner.report.terminal import module_range
from fxpipe.tracer.profile import ModelProfile, Unit

__all__ = ["ModuleGroup", "module_groups", "stage_bands_html", "module_tree_html", "stage_color"]

_EXPAND_SHARE = 0.25
_MAX_BOXES = 40
_PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#e15759",
    "#76b7b2",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
)


def stage_color(stage: int) -> str:
    """The colour of ``stage`` everywhere in the report."""
    return _PALETTE[stage % len(_PALETTE)]


@dataclass(frozen=True)
class ModuleGroup:
    """Consecutive units of one stage under one module of the tree (``path`` ``""``: the model's own code)."""

    path: str
    stage: int
    units: tuple[Unit, ...]

    @property
    def ms(self) -> float:
        return sum(u.fwd_ms + u.bwd_ms for u in self.units)

    @property
    def label(self) -> str:
        return self.path or "(model)"


def _weights(profile: ModelProfile) -> tuple[dict[str, float], dict[str, set[str]], float]:
    """Time under every module path prefix, each prefix's children, and the total (units count 1 when untimed)."""
    timed = any(u.fwd_ms + u.bwd_ms > 0 for u in profile.units)
    weight: dict[str, float] = {}
    children: dict[str, set[str]] = {}
    for u in profile.units:
        w = u.fwd_ms + u.bwd_ms if timed else 1.0
        parts = u.module_path.split(".") if u.module_path else []
        for d in range(1, len(parts) + 1):
            prefix = ".".join(parts[:d])
            weight[prefix] = weight.get(prefix, 0.0) + w
            if d < len(parts):
                children.setdefault(prefix, set()).add(".".join(parts[: d + 1]))
    total = sum(u.fwd_ms + u.bwd_ms if timed else 1.0 for u in profile.units)
    return weight, children, total


def _group_key(
    path: str, weight: dict[str, float], children: dict[str, set[str]], total: float
) -> str:
    parts = path.split(".") if path else []
    for d in range(1, len(parts) + 1):
        prefix = ".".join(parts[:d])
        if weight.get(prefix, 0.0) <= _EXPAND_SHARE * total or len(children.get(prefix, ())) < 2:
            return prefix
    return path


def module_groups(plan: PartitionPlan, profile: ModelProfile) -> list[list[ModuleGroup]]:
    """Per stage, its units grouped by the module tree (see the module docstring), in execution order."""
    weight, children, total = _weights(profile)
    out: list[list[ModuleGroup]] = [[] for _ in plan.stages]
    runs: list[list[tuple[str, list[Unit]]]] = [[] for _ in plan.stages]
    for u in profile.units:
        s = plan.stage_of(u.name)
        key = _group_key(u.module_path, weight, children, total)
        if runs[s] and runs[s][-1][0] == key:
            runs[s][-1][1].append(u)
        else:
            runs[s].append((key, [u]))
    for s, stage_runs in enumerate(runs):
        out[s] = [ModuleGroup(key, s, tuple(units)) for key, units in stage_runs]
    return out


def _boxes(groups: list[ModuleGroup]) -> list[tuple[int, int]]:
    """Ranges ``[a, b)`` of ``groups`` drawn as one box each: one per group, or balanced runs beyond ``_MAX_BOXES``."""
    n = len(groups)
    if n <= _MAX_BOXES:
        return [(i, i + 1) for i in range(n)]
    edges = [round(i * n / _MAX_BOXES) for i in range(_MAX_BOXES + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def _anchor(stage: int, index: int) -> str:
    return f"m{stage}-{index}"


def stage_bands_html(plan: PartitionPlan, groups: list[list[ModuleGroup]]) -> str:
    """One band per stage: module boxes and communication, widths proportional to time, band length to
    the stage's time against the bottleneck."""
    top = max((s.stage_ms for s in plan.stages), default=0.0) or 1.0
    ranks = plan.stage_ranks
    rows = []
    for st, stage_groups in zip(plan.stages, groups):
        color = stage_color(st.index)
        share = st.stage_ms / plan.bottleneck_ms if plan.bottleneck_ms > 0 else 1.0
        boxes = []
        for a, b in _boxes(stage_groups):
            members = stage_groups[a:b]
            ms = sum(g.ms for g in members) / (st.speed or 1.0)
            label = (
                members[0].label if len(members) == 1 else module_range([g.path for g in members])
            )
            units = sum(len(g.units) for g in members)
            tip = (
                f"{label}: {units} unit{'s' if units != 1 else ''}, {ms:.3f} ms (stage {st.index})"
            )
            boxes.append(
                f'<a class="box lbl" href="#{_anchor(st.index, a)}" style="flex-grow:{max(ms, 1e-9):.6g}"'
                f' title="{escape(tip)}">{escape(label)}</a>'
            )
        if st.comm_ms > 0:
            tip = (
                f"communication: {st.comm_ms:.3f} ms (sends {format_size(st.send_bytes)}, receives "
                f"{format_size(st.recv_bytes)})"
            )
            boxes.append(
                f'<span class="box comm lbl" style="flex-grow:{st.comm_ms:.6g}" title="{escape(tip)}">'
                "comm</span>"
            )
        bold = " bottleneck" if share >= 1 - 1e-9 else ""
        rows.append(
            f'<div class="band{bold}" style="--c:{color}">'
            f'<div class="bh"><div class="lbl"><span class="sw"></span>stage {st.index}'
            f"{f' (rank {ranks[st.index]})' if plan.virtual_stages > 1 else ''}</div>"
            f'<div class="lbl"><b>{st.stage_ms:.3f} ms</b> · {share:.0%}</div></div>'
            f'<div class="track"><div class="fill" style="width:{100 * st.stage_ms / top:.4f}%">{"".join(boxes)}'
            "</div></div></div>"
        )
    return f'<div class="bands" role="img" aria-label="stages: module boxes by time">{"".join(rows)}</div>'


def _unit_rows(group: ModuleGroup, speed: float) -> str:
    top = max((u.fwd_ms + u.bwd_ms for u in group.units), default=0.0) or 1.0
    rows = []
    for u in group.units:
        ms = (u.fwd_ms + u.bwd_ms) / (speed or 1.0)
        rows.append(
            f'<tr><td class="l">{escape(u.name)}</td><td class="l">{escape(u.module_type or u.kind)}</td>'
            f"<td>{u.fwd_ms:.3f}</td><td>{u.bwd_ms:.3f}</td><td>{format_size(u.param_bytes)}</td>"
            f"<td>{format_size(u.activation_bytes)}</td>"
            f'<td class="bar"><span style="width:{100 * (u.fwd_ms + u.bwd_ms) / top:.2f}%"></span></td>'
            f"<td>{ms:.3f}</td></tr>"
        )
    return "".join(rows)


def module_tree_html(plan: PartitionPlan, groups: list[list[ModuleGroup]]) -> str:
    """Per stage a ``<details>`` that opens to its modules, each a ``<details>`` that opens to its units."""
    parts = []
    for st, stage_groups in zip(plan.stages, groups):
        items = []
        top = max((g.ms for g in stage_groups), default=0.0) or 1.0
        for i, g in enumerate(stage_groups):
            params = sum(u.param_bytes for u in g.units)
            items.append(
                f'<details class="grp" id="{_anchor(st.index, i)}"><summary>'
                f'<span class="mini" style="width:{100 * g.ms / top:.2f}%"></span>'
                f"<b>{escape(g.label)}</b> {len(g.units)} unit{'s' if len(g.units) != 1 else ''}, "
                f"{g.ms / (st.speed or 1.0):.3f} ms, {format_size(params)} params</summary>"
                '<div class="scroll"><table class="units"><tr><th class="l">unit</th><th class="l">type</th>'
                "<th>fwd ms</th><th>bwd ms</th><th>params</th><th>activations</th><th>time</th><th>ms</th></tr>"
                f"{_unit_rows(g, st.speed)}</table></div></details>"
            )
        parts.append(
            f'<details class="stage" style="--c:{stage_color(st.index)}"><summary><span class="sw"></span>'
            f"stage {st.index}: {len(stage_groups)} module group{'s' if len(stage_groups) != 1 else ''}, "
            f"{len(st.units)} unit{'s' if len(st.units) != 1 else ''}, {st.compute_ms:.3f} ms compute"
            f"</summary>{''.join(items)}</details>"
        )
    return "".join(parts)
