"""``search_configurations``: the fastest way to train one profile on a cluster of N devices.

Note [cluster search]: a configuration is S pipeline ranks x R data-parallel replicas
(S x R <= N), M microbatches of ``b`` samples at a fixed global batch G = R x M x b, a
schedule with its V stages per rank, a sharding level over the replicas, and the stages
that recompute their activations. For each S the search keeps the most replicas that
divide G (fewer replicas only lengthen the step: each must then take more of the
batch; sharding, not fewer replicas, is what saves memory), and tries every M that
divides G / R and every schedule (``auto_candidates``): the shapes of ``search_shapes``.
The split of the units into S x V stages balances compute (the exact chain DP, once per
chunk count S x V: the units' costs scale together with b), and its cost at b comes from
scaling the profile (``scale_profile``: times, activations and messages linear in the batch).

Each shape gets a lower bound on its step: M x the busiest rank's compute, plus the least
step overheads of its split (``Pricer.bound``). In order of that bound, while it can still
beat the k-th best step found, each sharding level the runtime runs on the shape is priced
(``search_pricing``: each rank's peak over the schedule's walk, Note [fitting memory over
time], not the stage formula, which can be above or below it). A rank over the device
memory recomputes its stages (Note [recompute cost] in ``prediction``), so recompute is chosen
only where memory binds; a schedule that splits the backward gets none. Bounds on the
walk that need none (``prediction.rank_memory_floor``: the training state every step
ends with; a stage's in-flight activations beside its rank's weights and optimizer
state) reject a level, or make a rank recompute, before any walk. What fits is simulated
(``prediction.simulate_plan``: the one step simulator, Note [step simulation], with
inter-node messages on the inter-node link) plus the step's data-parallel collectives,
optimizer and fixed costs (``step_overheads``). The simulation of a shape is shared by
the sharding levels that recompute the same stages. ``search_explain`` says why the
others lose.

Note [what the job prices]: the search chooses the depth, replicas, microbatches, schedule,
sharding level and recomputation; what the job itself fixes (its precision, the sharded
levels' gather dtype and reduce timing, the gradient hook; ``PlanOptions.search_cost_fields``)
is ``cost_fields``, applied to every configuration's cost model and to the plan of the one
chosen, and recorded in the result (``SearchResult.cost_fields``) and its report. A field the
search sets itself is refused there, so nothing a user passes is silently priced otherwise.

>>> result = search_configurations(llama3_70b_profile(), ClusterSpec(64, parse_size("80GiB")), 256)  # doctest: +SKIP
>>> result.best.config.label                                                                        # doctest: +SKIP
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from fxpipe.errors import ConfigError, InfeasibleError, PartitionError, ScheduleError
from fxpipe.partitioner.solve.auto import auto_candidates
from fxpipe.partitioner.cluster import ClusterSpec
from fxpipe.partitioner.cost import SHARD_LEVELS, CostModel
from fxpipe.partitioner.plan import PartitionPlan
from fxpipe.partitioner.prediction import RuntimeCosts, runtime_costs_for
from fxpipe.partitioner.search.explain import Explanations
from fxpipe.partitioner.search.pricing import Pricer
from fxpipe.partitioner.search.shapes import (
    Shape,
    SplitCache,
    enumerate_shapes,
    least_bottleneck,
    scale_profile,
)
from fxpipe.partitioner.search.result import (
    Alternative,
    Configuration,
    ConfigurationScore,
    SearchResult,
)
from fxpipe.tracer.profile import ModelProfile

__all__ = [
    "Configuration",
    "ConfigurationScore",
    "Alternative",
    "SearchResult",
    "search_configurations",
    "scale_profile",
    "plan_configuration",
]


def search_configurations(
    profile: ModelProfile,
    cluster: ClusterSpec,
    global_batch: int,
    *,
    optimizer: str = "adam",
    schedules: tuple[str, ...] | None = None,
    shard_levels: tuple[str, ...] = SHARD_LEVELS,
    max_stages: int | None = None,
    stages: int | None = None,
    top: int = 5,
    runtime: RuntimeCosts | None = None,
    cost_fields: Mapping[str, Any] | None = None,
) -> SearchResult:
    """The ``top`` fastest configurations of ``profile`` on ``cluster`` at ``global_batch``
    samples per step (Note [cluster search]); ``stages`` fixes the pipeline depth (the
    replicas and the rest are still searched), ``max_stages`` caps it; ``cost_fields`` are the
    job's own cost-model fields (Note [what the job prices]). ``InfeasibleError`` when none
    fits."""
    start = time.perf_counter()
    job = check_cost_fields(cost_fields)
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError(f"global batch must be an int >= 1, got {global_batch!r}")
    if top < 1:
        raise ConfigError(f"top must be >= 1, got {top}")
    for level in shard_levels:
        if level not in SHARD_LEVELS:
            raise ConfigError(
                f"unknown shard level {level!r}; expected some of {list(SHARD_LEVELS)}"
            )
    kinds = [(n, v) for n, v in auto_candidates() if schedules is None or n in schedules]
    if not kinds:
        raise ConfigError(
            f"no known schedule among {schedules}; expected some of {[n for n, _ in auto_candidates()]}"
        )
    deepest = min(cluster.devices, len(profile.units), max_stages or cluster.devices)
    if stages is not None and not 1 <= stages <= deepest:
        raise ConfigError(
            f"--stages {stages} with --devices {cluster.devices}: the depth must be 1..{deepest} "
            f"(at most the devices and the model's {len(profile.units)} units)"
        )
    depths = range(stages, stages + 1) if stages is not None else range(1, deepest + 1)
    rt = (
        runtime
        if runtime is not None
        else runtime_costs_for(profile.trace_device, profile.host_slowdown)
    )
    search = _Search(profile, cluster, global_batch, optimizer, shard_levels, top, rt, job)
    shapes = enumerate_shapes(len(profile.units), cluster.devices, global_batch, kinds, depths)
    search.run(shapes)
    if not search.best:
        raise InfeasibleError(search.explain.nothing_fits())
    ranked = tuple(search.best)
    return SearchResult(
        cluster=cluster,
        global_batch=global_batch,
        optimizer=optimizer,
        ranked=ranked,
        alternatives=search.explain.alternatives(ranked[0], search.cutoff()),
        candidates=len(shapes),
        priced=search.pricer.priced,
        simulated=search.pricer.simulated,
        seconds=time.perf_counter() - start,
        cost_fields=job,
    )


# what the search chooses per configuration, or takes from its own arguments and the cluster
_SEARCHED = frozenset(
    {"optimizer", "shard", "dp_replicas", "recompute", "node_size"}
    | {f.name for f in fields(CostModel) if f.name.startswith(("link", "inter_link"))}
)


def check_cost_fields(cost_fields: Mapping[str, Any] | None) -> dict[str, Any]:
    """``cost_fields`` as a plain dict, checked: cost-model fields the search does not set
    itself (Note [what the job prices]); ``ConfigError`` otherwise."""
    job = dict(cost_fields or {})
    known = {f.name for f in fields(CostModel)}
    for name in job:
        if name not in known or name in _SEARCHED:
            raise ConfigError(
                f"the cluster search cannot take {name!r} as a fixed cost-model field: it "
                f"{'chooses it itself' if name in _SEARCHED else 'is not one'}"
            )
    return job


class _Search:
    """One search: the shapes in lower-bound order, the top k so far, what the explanation needs."""

    def __init__(
        self,
        profile: ModelProfile,
        cluster: ClusterSpec,
        global_batch: int,
        optimizer: str,
        shard_levels: tuple[str, ...],
        top: int,
        runtime: RuntimeCosts,
        cost_fields: Mapping[str, Any] | None = None,
    ) -> None:
        self.profile, self.top, self.rt = profile, top, runtime
        self.splits = SplitCache(profile, cluster)
        self.pricer = Pricer(
            profile, cluster, global_batch, optimizer, shard_levels, runtime, cost_fields
        )
        self.explain = Explanations(cluster, top)
        self.best: list[ConfigurationScore] = []  # the top k so far
        self.compute_ms = [u.fwd_ms + u.bwd_ms for u in profile.units]
        self.busiest: dict[tuple[int, int], float] = {}

    def cutoff(self) -> float:
        """The k-th best step so far (a shape whose bound is above it cannot enter the top k)."""
        return self.best[-1].step_ms if len(self.best) >= self.top else math.inf

    def _coarse_bound(self, shape: Shape) -> float:
        """M x the least busiest rank any split could give (no split needed), plus the fixed step cost:
        one stage per rank holds at least the least bottleneck of S contiguous parts, a rank of V
        chunks at least the largest of S x V parts and its share of the model."""
        S, V = shape.stages, shape.virtual_stages
        if (S, V) not in self.busiest:
            total = sum(self.compute_ms)
            self.busiest[(S, V)] = max(total / S, least_bottleneck(self.compute_ms, S * V))
        scale = shape.microbatch_size / self.profile.batch_size
        return shape.microbatches * self.busiest[(S, V)] * scale + self.rt.step_ms

    def run(self, shapes: list[Shape]) -> None:
        """Price the shapes in order of their lower bound, first the coarse one, then, when a
        shape comes up, its split's (``Pricer.bound``); stop at the cut-off."""
        queue = [(self._coarse_bound(shape), i, False) for i, shape in enumerate(shapes)]
        heapq.heapify(queue)
        while queue:
            bound, i, refined = heapq.heappop(queue)
            shape = shapes[i]
            if bound > self.cutoff():
                for b, j, _ in [(bound, i, refined), *queue]:
                    self.explain.not_priced(shapes[j], b)
                return
            split = self.splits.split(shape.stages, shape.virtual_stages, shape.placement)
            if split is None:
                continue
            if not refined:
                heapq.heappush(queue, (self.pricer.bound(shape, split), i, True))
                continue
            try:
                self.pricer.price(
                    shape,
                    split,
                    self.cutoff,
                    self._keep,
                    lambda shard, need: self.explain.too_big(shape, shard, need),
                )
            except (ScheduleError, PartitionError) as exc:
                self.explain.failed(shape, exc)

    def _keep(self, score: ConfigurationScore) -> None:
        """Record ``score`` for the explanation, and in the top k if it beats the cut-off."""
        self.explain.scored(score)
        if len(self.best) < self.top or _rank_key(score) < _rank_key(self.best[-1]):
            self.best.append(score)
            self.best.sort(key=_rank_key)
            del self.best[self.top :]


def _rank_key(score: ConfigurationScore) -> tuple[float, int, str]:
    """The ranking: the fastest step, then the fewest devices, then by name (so that the top k do
    not depend on the order in which configurations were priced)."""
    return score.step_ms, score.config.devices, score.config.label


def plan_configuration(
    profile: ModelProfile,
    cluster: ClusterSpec,
    config: Configuration,
    *,
    optimizer: str = "adam",
    time_limit: float = 10.0,
    cost_fields: Mapping[str, Any] | None = None,
) -> PartitionPlan:
    """The plan of one searched configuration: ``plan_partition`` at its microbatch size, with its
    replicas, sharding, recomputed stages, the cluster's links and device memory and the job's
    ``cost_fields`` (Note [what the job prices])."""
    from fxpipe.partitioner.solve.planner import plan_partition

    cost = cluster.cost_model(
        config.replicas,
        optimizer=optimizer,
        shard=config.shard,
        recompute=config.recompute,
        **check_cost_fields(cost_fields),
    )
    return plan_partition(
        scale_profile(profile, config.microbatch_size),
        config.stages,
        schedule=config.schedule,
        microbatches=config.microbatches,
        cost=cost,
        memory_limit=cluster.device_memory,
        time_limit=time_limit,
        virtual_stages=config.virtual_stages,
    )
