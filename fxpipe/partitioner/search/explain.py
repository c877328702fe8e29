"""Why the other configurations of a cluster search lose (``--explain``): per pipeline depth,
schedule and sharding level, the best one's difference to the best, or why none could run."""

from __future__ import annotations

from fxpipe.partitioner.cluster import ClusterSpec
from fxpipe.partitioner.cost import format_size
from fxpipe.partitioner.schedule import schedule_kind
from fxpipe.partitioner.search.pricing import format_ms
from fxpipe.partitioner.search.shapes import Shape
from fxpipe.partitioner.search.result import Alternative, ConfigurationScore

__all__ = ["Explanations", "groups_of"]

Group = tuple[str, str]


def groups_of(shape: Shape, shard: str | None = None) -> list[Group]:
    """The explanation groups a shape belongs to: its depth, its schedule, its sharding level."""
    v = f" V={shape.virtual_stages}" if shape.virtual_stages > 1 else ""
    out = [("depth", str(shape.stages)), ("schedule", shape.schedule + v)]
    return out + [("shard", shard)] if shard is not None else out


class Explanations:
    """What a search saw of each group: its best score, the least memory a shape of it that did
    not fit needed, the least lower bound of a shape of it never priced, errors."""

    def __init__(self, cluster: ClusterSpec, top: int) -> None:
        self.cluster, self.top = cluster, top
        self.by_group: dict[Group, ConfigurationScore] = {}
        self.notes: dict[Group, str] = {}  # why a group could not run at all
        self.need: dict[Group, int] = {}  # the least memory a shape that did not fit needed
        self.pruned: dict[Group, float] = {}  # the least lower bound of a shape not priced

    def scored(self, score: ConfigurationScore) -> None:
        c = score.config
        v = f" V={c.virtual_stages}" if c.virtual_stages > 1 else ""
        for group in (("depth", str(c.stages)), ("schedule", c.schedule + v), ("shard", c.shard)):
            old = self.by_group.get(group)
            if old is None or score.step_ms < old.step_ms:
                self.by_group[group] = score

    def too_big(self, shape: Shape, shard: str, need: int) -> None:
        for group in groups_of(shape, shard):
            self.need[group] = min(self.need.get(group, need), need)

    def not_priced(self, shape: Shape, bound: float) -> None:
        for group in groups_of(shape):
            self.pruned[group] = min(self.pruned.get(group, bound), bound)

    def failed(self, shape: Shape, error: Exception) -> None:
        self.notes.setdefault(groups_of(shape)[1], f"cannot run some shapes: {error}")

    def _why_none(self, group: Group, cutoff: float) -> str:
        """Why no configuration of ``group`` was priced: its lower bound, memory, or the schedule."""
        parts = []
        if group in self.pruned:
            parts.append(
                f"its least lower bound on the step ({format_ms(self.pruned[group])}) is above the "
                f"{self.top} best steps found (up to {format_ms(cutoff)})"
            )
        if group in self.need:
            limit = format_size(self.cluster.device_memory or 0)
            split = group[0] == "schedule" and schedule_kind(group[1].split()[0]).split_backward
            parts.append(
                f"what was priced needs at least {format_size(self.need[group])} on a device, over {limit}"
                + (" (a split backward is not recomputed)" if split else " even recomputing")
            )
        if group in self.notes:
            parts.append(self.notes[group])
        return "; ".join(parts)

    def alternatives(self, best: ConfigurationScore, cutoff: float) -> tuple[Alternative, ...]:
        out = []
        groups = sorted(
            {*self.by_group, *self.notes, *self.need, *self.pruned},
            key=lambda g: (g[0], int(g[1]) if g[0] == "depth" else 0, g[1]),
        )
        for group, value in groups:
            score = self.by_group.get((group, value))
            if score is None:
                out.append(Alternative(group, value, None, self._why_none((group, value), cutoff)))
            elif score.config == best.config:
                out.append(
                    Alternative(group, value, score.step_ms, f"the best: {score.config.label}")
                )
            else:
                out.append(Alternative(group, value, score.step_ms, _why_slower(score, best)))
        return tuple(out)

    def nothing_fits(self) -> str:
        """The message when no configuration could be planned."""
        limit = self.cluster.device_memory
        least = min((n for (g, _), n in self.need.items() if g == "depth"), default=None)
        if limit is not None and least is not None:
            return (
                f"no configuration fits {format_size(limit)} per device on {self.cluster.devices} devices: each "
                f"needs at least {format_size(least)} (with the sharding levels tried, recomputing); add "
                "devices or memory, or lower the global batch"
            )
        return (
            f"no configuration could be planned on {self.cluster.devices} devices; check the global batch and "
            "schedules"
        )


def _why_slower(score: ConfigurationScore, best: ConfigurationScore) -> str:
    """Where ``score``'s step loses to ``best``'s, the largest difference first."""
    ratio = score.step_ms / best.step_ms if best.step_ms > 0 else 1.0
    compute = (score.pipeline_ms * (1 - score.bubble) - score.recompute_ms) - (
        best.pipeline_ms * (1 - best.bubble) - best.recompute_ms
    )
    diffs = {
        "bubble": score.pipeline_ms * score.bubble - best.pipeline_ms * best.bubble,
        "data-parallel collectives": score.dp_ms - best.dp_ms,
        "recompute": score.recompute_ms - best.recompute_ms,
        "compute per device": compute,
    }
    losses = [
        f"{k} +{format_ms(v)}"
        for k, v in sorted(diffs.items(), key=lambda kv: -kv[1])
        if v > 0.01 * best.step_ms
    ]
    return f"{ratio:.2f}x the best step ({score.config.label}): " + (
        ", ".join(losses[:3]) or "slightly slower"
    )
