"""Pricing one shape of the cluster search: memory per device at each sharding level, recompute
where memory binds, and the simulated step of what fits (Note [cluster search] in ``search``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any
from dataclasses import replace

from fxpipe.partitioner.cluster import ClusterSpec
from fxpipe.partitioner.prediction import (
    RuntimeCosts,
    StepOverheads,
    rank_memory_floor,
    rank_peak_memory,
    simulate_plan,
    step_overheads,
)
from fxpipe.partitioner.problem import PartitionProblem, build_problem, evaluate
from fxpipe.partitioner.schedule import Timeline
from fxpipe.partitioner.search.shapes import (
    Shape,
    Split,
    pipeline_floor,
    runnable_shard_levels,
    scale_profile,
)
from fxpipe.partitioner.search.result import Configuration, ConfigurationScore
from fxpipe.tracer.profile import ModelProfile

__all__ = ["Pricer", "format_ms"]

_MINOR = 0.05  # a part of the step below this share does not limit it


def format_ms(ms: float) -> str:
    return f"{ms / 1e3:.3g} s" if ms >= 1e3 else f"{ms:.3g} ms"


class Pricer:
    """Prices shapes of one search, caching what shapes share: scaled profiles, problems, the
    step-overhead floor of a split and replica count, step overheads, simulations (per shape and
    recompute)."""

    def __init__(
        self,
        profile: ModelProfile,
        cluster: ClusterSpec,
        global_batch: int,
        optimizer: str,
        shard_levels: tuple[str, ...],
        runtime: RuntimeCosts,
        cost_fields: Mapping[str, Any] | None = None,
    ) -> None:
        self.cost_fields = dict(cost_fields or {})  # the job's own (Note [what the job prices])
        self.profile, self.cluster, self.G, self.optimizer = (
            profile,
            cluster,
            global_batch,
            optimizer,
        )
        self.shard_levels, self.rt = shard_levels, runtime
        self.priced = self.simulated = 0
        self._scaled: dict[int, ModelProfile] = {}
        self._problems: dict[tuple[int, int, str, int], PartitionProblem] = {}
        self._placed: dict[tuple[int, int, str, int], PartitionProblem] = {}
        self._floors: dict[tuple[int, int, str, int, tuple[str, ...]], float] = {}
        self._overheads: dict[tuple[int, int, str, int, int, str], StepOverheads] = {}
        self._timelines: dict[tuple[Shape, tuple[bool, ...]], Timeline] = {}

    def problem(self, shape: Shape) -> PartitionProblem:
        """The shape's partition problem at its microbatch size (one per size, depth, schedule and V)."""
        key = (shape.microbatch_size, shape.stages, shape.schedule, shape.virtual_stages)
        if key not in self._problems:
            # the schedules of one placement share all but the schedule's name: build it once
            placed = (shape.microbatch_size, shape.stages, shape.placement, shape.virtual_stages)
            if placed not in self._placed:
                if shape.microbatch_size not in self._scaled:
                    self._scaled[shape.microbatch_size] = scale_profile(
                        self.profile, shape.microbatch_size
                    )
                self._placed[placed] = build_problem(
                    self._scaled[shape.microbatch_size],
                    shape.stages,
                    schedule=shape.schedule,
                    virtual_stages=shape.virtual_stages,
                )
            self._problems[key] = replace(self._placed[placed], schedule=shape.schedule)
        return self._problems[key]

    def bound(self, shape: Shape, split: Split) -> float:
        """A lower bound on the step of every configuration of ``shape``: the pipeline's floor
        (``pipeline_floor``) on the split's compute, plus the least step overheads."""
        tail = _tail(shape)
        scale = shape.microbatch_size / self.profile.batch_size
        pipeline = pipeline_floor(
            shape.microbatches, split.rank_ms, split.first_fwd_ms, split.first_bwd_ms, tail
        )
        return pipeline * scale + self._overhead_floor(shape, split)

    def _overhead_floor(self, shape: Shape, split: Split) -> float:
        """The least step overheads (optimizer, data-parallel collectives, fixed costs) over the
        shape's sharding levels: they do not depend on the microbatch size, and the collectives
        grow with M (sharding gathers at least once per step), so M = 1 bounds them."""
        levels = runnable_shard_levels(shape, self.shard_levels)
        key = (shape.stages, shape.virtual_stages, shape.placement, shape.replicas, levels)
        if key not in self._floors:
            one = replace(shape, microbatches=1, microbatch_size=self.profile.batch_size)
            problem = replace(self.problem(one), microbatches=1)
            self._floors[key] = min(
                self._step_overheads(
                    one,
                    level,
                    replace(
                        problem,
                        cost=self.cluster.cost_model(
                            shape.replicas,
                            optimizer=self.optimizer,
                            shard=level,
                            **self.cost_fields,
                        ),
                    ),
                    split.assignment,
                ).total_ms
                for level in levels
            )
        return self._floors[key]

    def _step_overheads(
        self, shape: Shape, shard: str, problem: PartitionProblem, assignment: tuple[int, ...]
    ) -> StepOverheads:
        """``step_overheads`` of ``problem``, shared by the shapes that differ only in the schedule of
        one placement, or in the microbatch size (neither changes them), and by their recomputes."""
        key = (
            shape.stages,
            shape.virtual_stages,
            shape.placement,
            shape.replicas,
            shape.microbatches,
            shard,
        )
        if key not in self._overheads:
            self._overheads[key] = step_overheads(problem, assignment, self.rt)
        return self._overheads[key]

    def price(
        self,
        shape: Shape,
        split: Split,
        cutoff: Callable[[], float],
        keep: Callable[[ConfigurationScore], None],
        too_big: Callable[[str, int], None],
    ) -> None:
        """Every runnable sharding level of ``shape``: the simulated step (``keep``) of those that
        can still beat ``cutoff()`` and whose schedule walk fits the device memory, recomputing
        the stages of the ranks over it (unless the backward is split); ``too_big(level, bytes)``
        for those that do not fit (Note [fitting memory over time]: the walk, not the stage
        formula, says what fits)."""
        S, M = shape.stages, shape.microbatches
        assignment = split.assignment
        limit = self.cluster.device_memory
        base = self.cluster.cost_model(shape.replicas, optimizer=self.optimizer, **self.cost_fields)
        problem = replace(self.problem(shape), microbatches=M, cost=base, memory_limit=limit)
        ev = evaluate(problem, assignment)
        self.priced += 1
        tail = _tail(shape)
        first_fwd = [ev.stages[r].fwd_ms for r in range(S)]
        first_bwd = [ev.stages[r].bwd_ms for r in range(S)]
        busy = [0.0] * S
        for st in ev.stages:
            busy[st.rank] += st.compute_ms
        for shard in runnable_shard_levels(shape, self.shard_levels):
            cost = replace(base, shard=shard)
            plain = replace(problem, cost=cost)
            floor = rank_memory_floor(plain, assignment, self.rt) if limit is not None else None
            cap = limit if limit is not None else 0  # read only where there is a floor
            if (
                floor is not None and max(floor.at_end) > cap
            ):  # every walk holds this: over, recompute or not
                too_big(shard, max(floor.at_end))
                continue
            overheads = self._step_overheads(shape, shard, plain, assignment)
            if pipeline_floor(M, busy, first_fwd, first_bwd, tail) + overheads.total_ms > cutoff():
                continue  # recomputing only lengthens it
            recompute: tuple[bool, ...] = ()
            if (
                floor is not None
            ):  # ranks whose walk must be over with every activation kept recompute
                over = {r for r in range(S) if floor.always[r] + floor.activations[r] > cap}
                least = max((floor.always[r] + floor.recomputed[r] for r in over), default=0)
                if over and (shape.split_backward or least > cap):
                    too_big(
                        shard,
                        least
                        if not shape.split_backward
                        else max(floor.always[r] + floor.activations[r] for r in over),
                    )
                    continue
                recompute = (
                    tuple(problem.stage_ranks[s] in over for s in range(problem.num_stages))
                    if over
                    else ()
                )
            priced = (
                replace(problem, cost=replace(cost, recompute=recompute)) if recompute else plain
            )
            peaks = rank_peak_memory(
                priced, assignment, shape.schedule, self.rt
            )  # Note [fitting memory over time]
            if limit is not None and max(peaks) > limit and not shape.split_backward:
                more = tuple(
                    bool(recompute and recompute[s]) or peaks[problem.stage_ranks[s]] > limit
                    for s in range(problem.num_stages)
                )
                if more != recompute:
                    recompute = more
                    priced = replace(problem, cost=replace(cost, recompute=recompute))
                    peaks = rank_peak_memory(priced, assignment, shape.schedule, self.rt)
            walked = max(peaks)
            if limit is not None and walked > limit:
                too_big(shard, walked)
                continue
            if recompute:
                extra = list(busy)
                for s, st in enumerate(ev.stages):
                    extra[st.rank] += st.fwd_ms if recompute[s] else 0.0
                if (
                    pipeline_floor(M, extra, first_fwd, first_bwd, tail) + overheads.total_ms
                    > cutoff()
                ):
                    continue
            key = (shape, recompute)
            if key not in self._timelines:
                timed = evaluate(priced, assignment) if recompute else ev
                self._timelines[key] = simulate_plan(priced, assignment, self.rt, evaluation=timed)
                self.simulated += 1
            keep(
                self._score(
                    shape,
                    shard,
                    recompute,
                    self._timelines[key],
                    overheads,
                    walked,
                    assignment,
                    [st.fwd_ms for st in ev.stages],
                    problem.stage_ranks,
                )
            )

    def _score(
        self,
        shape: Shape,
        shard: str,
        recompute: tuple[bool, ...],
        line: Timeline,
        overheads: StepOverheads,
        memory: int,
        assignment: tuple[int, ...],
        fwd_ms: list[float],
        ranks: tuple[int, ...],
    ) -> ConfigurationScore:
        step = line.step_ms + overheads.total_ms
        busy = max(line.busy_ms())
        extra = [0.0] * shape.stages
        for s, flag in enumerate(recompute):
            if flag:
                extra[ranks[s]] += shape.microbatches * fwd_ms[s]
        config = Configuration(
            shape.stages,
            shape.replicas,
            shape.microbatches,
            shape.microbatch_size,
            shape.schedule,
            shape.virtual_stages,
            shard,
            recompute,
        )
        parts = {
            "pipeline bubble": line.step_ms - busy,
            "data-parallel collectives": overheads.dp_all_reduce_ms,
            "recompute": max(extra),
            "optimizer step": overheads.optimizer_ms,
        }
        name, worst = max(parts.items(), key=lambda kv: kv[1])
        limit_text = (
            f"{name} {format_ms(worst)} ({worst / step:.0%} of the step)"
            if worst >= _MINOR * step
            else "compute"
        )
        if recompute:
            limit_text += "; memory-bound (recomputes)"
        return ConfigurationScore(
            config=config,
            step_ms=step,
            samples_per_s=self.G / (step / 1e3),
            pipeline_ms=line.step_ms,
            bubble=line.bubble,
            peak_memory_bytes=memory,
            dp_ms=overheads.dp_all_reduce_ms,
            recompute_ms=max(extra),
            limit=limit_text,
            assignment=assignment,
        )


def _tail(shape: Shape) -> bool:
    """Whether the last gradient must still pass back through the ranks before rank r after r's
    last action (``pipeline_floor``'s ``tail``): with a fused backward and loop placement, rank r's
    last action is a backward of its first stage r (every backward of its later stages S·k + r
    precedes that microbatch's backward of stage r), then stages r-1 .. 0 follow."""
    return not shape.split_backward and shape.placement == "loop"
