"""``search_configurations``: the fastest way to train one profile on a cluster of N devices.

Note [cluster search]: a configuration is S pipeline ranks x R data-parallel replicas
(S x R <= N), M microbatches of ``b`` samples at a fixed global batch G = R x M x b, a
schedule with its V stages per rank, a sharding level over the replicas, and the stages
that recompute their activations. For each S the search keeps the most replicas that
divide G (fewer replicas only lengthen the step: each must then take more of the
batch; sharding, not fewer replicas, is what saves memory), and tries every M that
divides G / R and every schedule (``auto_candidates``). The split of the units into
S x V stages balances compute (the exact chain DP, once per S x V and placement: the
units' costs scale together with b), and its cost at b comes from scaling the profile
(``scale_profile``: times, activations and messages linear in the batch).

Each (S, R, M, schedule) gets a lower bound on its step: M x the busiest rank's compute.
In order of that bound, while it can still beat the k-th best step found, each sharding
level is priced (``evaluate``: per-device memory; Note [stage cost]). A rank over the
device memory recomputes its stages (Note [cluster links] in ``cost``), so recompute is
chosen only where memory binds; a schedule that splits the backward gets none. What
fits is simulated (``prediction.simulate_plan``: the one step simulator, Note [step
simulation], with inter-node messages on the inter-node link) plus the step's
data-parallel collectives, optimizer and fixed costs (``step_overheads``). The
simulation of a shape is shared by the sharding levels that recompute the same stages.

>>> result = search_configurations(llama3_70b_profile(), ClusterSpec(64, parse_size("80GiB")), 256)  # doctest: +SKIP
>>> result.best.config.label                                                                        # doctest: +SKIP
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from fxpipe.errors import ConfigError, InfeasibleError, PartitionError, ScheduleError
from fxpipe.partitioner.auto import auto_candidates
from fxpipe.partitioner.cluster import ClusterSpec
from fxpipe.partitioner.cost import SHARD_LEVELS, format_size
from fxpipe.partitioner.dp import solve_chain_dp
from fxpipe.partitioner.plan import PartitionPlan
from fxpipe.partitioner.prediction import RUNTIME_COSTS, RuntimeCosts, StepOverheads, simulate_plan, step_overheads
from fxpipe.partitioner.problem import Evaluation, PartitionProblem, build_problem, evaluate
from fxpipe.partitioner.schedule import Timeline, schedule_kind, stage_ranks
from fxpipe.schema import NonNegFloat, NonNegInt, PositiveInt, read_dataclass
from fxpipe.tracer.profile import ModelProfile, TensorSpec

__all__ = ["Configuration", "ConfigurationScore", "Alternative", "SearchResult", "search_configurations",
           "scale_profile", "plan_configuration"]

_MINOR = 0.05  # a part of the step below this share does not limit it


@dataclass(frozen=True)
class Configuration:
    """How to run one training step on the cluster (Note [cluster search])."""

    stages: PositiveInt               # pipeline ranks S
    replicas: PositiveInt             # data-parallel replicas R
    microbatches: PositiveInt         # M per replica per step
    microbatch_size: PositiveInt      # samples per microbatch
    schedule: str
    virtual_stages: PositiveInt = 1   # stages per rank
    shard: str = "none"
    recompute: tuple[bool, ...] = ()  # per stage (S x V of them): recompute activations in backward

    @property
    def devices(self) -> int:
        return self.stages * self.replicas

    @property
    def label(self) -> str:
        v = f" V={self.virtual_stages}" if self.virtual_stages > 1 else ""
        rc = sum(self.recompute)
        recompute = f", recompute {rc}/{len(self.recompute)} stages" if rc else ""
        return (f"S={self.stages} x R={self.replicas}, M={self.microbatches} x {self.microbatch_size}, "
                f"{self.schedule}{v}, shard {self.shard}{recompute}")


@dataclass(frozen=True)
class ConfigurationScore:
    """A configuration's predicted step: its time, throughput, bubble, memory and what limits it."""

    config: Configuration
    step_ms: NonNegFloat
    samples_per_s: NonNegFloat
    pipeline_ms: NonNegFloat           # the simulated forward/backward part of the step
    bubble: NonNegFloat                # idle share of the pipeline part
    peak_memory_bytes: NonNegInt       # the fullest device
    dp_ms: NonNegFloat                 # the slowest stage's data-parallel collectives
    recompute_ms: NonNegFloat          # extra forward time per step on the busiest rank
    limit: str                         # what limits it, in words
    assignment: tuple[NonNegInt, ...] = ()


@dataclass(frozen=True)
class Alternative:
    """Why the best of one group of configurations (``group``: pipeline depth, schedule or
    sharding level; ``value``: which) loses to the best, or why none of it could run."""

    group: str
    value: str
    step_ms: NonNegFloat | None
    note: str


@dataclass(frozen=True)
class SearchResult:
    """The ranked configurations (best first), and ``alternatives`` for ``--explain``."""

    cluster: ClusterSpec
    global_batch: PositiveInt
    optimizer: str
    ranked: tuple[ConfigurationScore, ...]
    alternatives: tuple[Alternative, ...]
    candidates: NonNegInt
    priced: NonNegInt
    simulated: NonNegInt
    seconds: NonNegFloat

    @property
    def best(self) -> ConfigurationScore:
        return self.ranked[0]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SearchResult:
        return read_dataclass(cls, d, "cluster search", ConfigError)


@dataclass(frozen=True)
class _Shape:
    stages: int
    replicas: int
    microbatches: int
    microbatch_size: int
    schedule: str
    virtual_stages: int


# a split (stage of each unit) and per rank at the traced batch: compute, its first stage's forward and backward
_Split = tuple[tuple[int, ...], tuple[float, ...], tuple[float, ...], tuple[float, ...]]


def scale_profile(profile: ModelProfile, batch: int) -> ModelProfile:
    """``profile`` as if traced at ``batch`` samples: times, FLOPs, activations, edges and
    batch dimensions scaled linearly (fixed per-call costs are not separated out)."""
    if batch == profile.batch_size:
        return profile
    r = batch / profile.batch_size

    def spec(s: TensorSpec) -> TensorSpec:
        if s.batch_dim is None or s.shape[s.batch_dim] % profile.batch_size:
            return s
        return replace(s, shape=s.at_batch(batch, profile.batch_size))

    units = tuple(replace(u, fwd_ms=u.fwd_ms * r, bwd_ms=u.bwd_ms * r, fwd_flops=u.fwd_flops * r,
                          activation_bytes=round(u.activation_bytes * r), outputs=tuple(spec(o) for o in u.outputs))
                  for u in profile.units)
    edges = tuple(replace(e, bytes=round(e.bytes * r)) for e in profile.edges)
    return replace(profile, units=units, edges=edges, batch_size=batch, inputs=tuple(spec(s) for s in profile.inputs))


def search_configurations(profile: ModelProfile, cluster: ClusterSpec, global_batch: int, *,
                          optimizer: str = "adam", schedules: tuple[str, ...] | None = None,
                          shard_levels: tuple[str, ...] = SHARD_LEVELS, max_stages: int | None = None,
                          top: int = 5, runtime: RuntimeCosts | None = None) -> SearchResult:
    """The ``top`` fastest configurations of ``profile`` on ``cluster`` at ``global_batch``
    samples per step (Note [cluster search]); ``InfeasibleError`` when none fits."""
    start = time.perf_counter()
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError(f"global batch must be an int >= 1, got {global_batch!r}")
    if top < 1:
        raise ConfigError(f"top must be >= 1, got {top}")
    for level in shard_levels:
        if level not in SHARD_LEVELS:
            raise ConfigError(f"unknown shard level {level!r}; expected some of {list(SHARD_LEVELS)}")
    kinds = [(n, v) for n, v in auto_candidates() if schedules is None or n in schedules]
    if not kinds:
        raise ConfigError(f"no known schedule among {schedules}; expected some of {[n for n, _ in auto_candidates()]}")
    rt = runtime if runtime is not None else RUNTIME_COSTS.get(profile.trace_device, RUNTIME_COSTS["cpu"])
    search = _Search(profile, cluster, global_batch, optimizer, shard_levels, top, rt)
    deepest = min(cluster.devices, len(profile.units), max_stages or cluster.devices)
    for S in range(1, deepest + 1):
        search.add_depth(S, kinds)
    search.run()
    if not search.best:
        raise InfeasibleError(_nothing_fits(search, cluster))
    ranked = tuple(sorted(search.best, key=lambda s: (s.step_ms, s.config.devices, s.config.label)))
    return SearchResult(cluster=cluster, global_batch=global_batch, optimizer=optimizer, ranked=ranked,
                        alternatives=search.alternatives(ranked[0]), candidates=len(search.shapes),
                        priced=search.priced, simulated=search.simulated, seconds=time.perf_counter() - start)


class _Search:
    """The state of one search: shapes, cached splits, problems and simulations, the best so far."""

    def __init__(self, profile: ModelProfile, cluster: ClusterSpec, global_batch: int, optimizer: str,
                 shard_levels: tuple[str, ...], top: int, runtime: RuntimeCosts) -> None:
        self.profile, self.cluster, self.G, self.optimizer = profile, cluster, global_batch, optimizer
        self.shard_levels, self.top, self.rt = shard_levels, top, runtime
        self.shapes: list[tuple[float, _Shape]] = []
        self.splits: dict[tuple[int, int, str], _Split | None] = {}
        self.scaled: dict[int, ModelProfile] = {}
        self.chunk_splits: dict[int, tuple[int, ...] | None] = {}
        self.problems: dict[tuple[int, int, str, int], PartitionProblem] = {}
        self.timelines: dict[tuple[_Shape, tuple[bool, ...]], Timeline] = {}
        self.best: list[ConfigurationScore] = []       # the top k so far
        self.heap: list[tuple[float, int]] = []         # -step of the top k, for the cut-off
        self.by_group: dict[tuple[str, str], ConfigurationScore] = {}
        self.notes: dict[tuple[str, str], str] = {}     # why a group could not run at all
        self.need: dict[tuple[str, str], int] = {}      # per group: the least memory a shape that did not fit needed
        self.pruned: dict[tuple[str, str], float] = {}  # per group: the least lower bound of a shape not priced
        self.priced = self.simulated = 0
        compute = [u.fwd_ms + u.bwd_ms for u in profile.units]
        self.total_ms, self.largest_ms = sum(compute), max(compute)
        self.dp_floor: dict[tuple[int, int, str, int], float] = {}

    # -- candidates -----------------------------------------------------------

    def add_depth(self, S: int, kinds: list[tuple[str, int]]) -> None:
        R = max(r for r in range(1, self.cluster.devices // S + 1) if self.G % r == 0)
        per_replica = self.G // R
        for M in (m for m in range(1, per_replica + 1) if per_replica % m == 0):
            for name, V in kinds:
                if S * V > len(self.profile.units):
                    continue
                shape = _Shape(S, R, M, per_replica // M, name, V)
                scale = shape.microbatch_size / self.profile.batch_size
                self.shapes.append((M * max(self.total_ms / S, self.largest_ms) * scale + self.rt.step_ms, shape))

    def _split(self, S: int, V: int, name: str) -> _Split | None:
        """The compute-balanced split of the units into S x V stages, and per rank at the traced batch:
        its compute, and the forward and backward of its first stage."""
        placement = schedule_kind(name).placement if V > 1 else "loop"
        key = (S, V, placement)
        if key not in self.splits:
            chunks = self._chunks(S * V)
            if chunks is None:
                self.splits[key] = None
                return None
            ranks = stage_ranks(S, V, placement)
            rank_ms, fwd, bwd = [0.0] * S, [0.0] * S, [0.0] * S
            for u, s in enumerate(chunks):
                unit = self.profile.units[u]
                rank_ms[ranks[s]] += unit.fwd_ms + unit.bwd_ms
                if s < S:  # rank s's first stage, under both placements
                    fwd[s] += unit.fwd_ms
                    bwd[s] += unit.bwd_ms
            self.splits[key] = (chunks, tuple(rank_ms), tuple(fwd), tuple(bwd))
        return self.splits[key]

    def _chunks(self, count: int) -> tuple[int, ...] | None:
        """The compute-balanced contiguous split into ``count`` stages (the exact chain DP; one per
        count, whatever the ranks and placement: the solver's messages are small beside compute)."""
        if count not in self.chunk_splits:
            try:
                problem = build_problem(self.profile, count, cost=self.cluster.cost_model())
                self.chunk_splits[count] = solve_chain_dp(problem).assignment
            except (PartitionError, ScheduleError):
                self.chunk_splits[count] = None
        return self.chunk_splits[count]

    def _bound(self, shape: _Shape, rank_ms: tuple[float, ...], fwd: tuple[float, ...],
               bwd: tuple[float, ...]) -> float:
        """A lower bound on the step: rank r cannot start before microbatch 0 has passed the
        stages before it, then computes M x its stages; with one unsplit stage per rank, the
        last gradient must then pass back through the stages before it. Plus the fixed step cost."""
        scale = shape.microbatch_size / self.profile.batch_size
        tail = shape.virtual_stages == 1 and not schedule_kind(shape.schedule).split_backward
        best = before_f = before_b = 0.0
        for r in range(shape.stages):
            best = max(best, before_f + shape.microbatches * rank_ms[r] + (before_b if tail else 0.0))
            before_f += fwd[r]
            before_b += bwd[r]
        return best * scale + self.rt.step_ms + self._dp_floor(shape)

    def _dp_floor(self, shape: _Shape) -> float:
        """The least data-parallel time of the shape's split over the sharding levels (sharding
        fully gathers at least once per step, so M = 1 bounds it)."""
        placement = schedule_kind(shape.schedule).placement if shape.virtual_stages > 1 else "loop"
        key = (shape.stages, shape.virtual_stages, placement, shape.replicas)
        if shape.replicas == 1:
            return 0.0
        if key not in self.dp_floor:
            split = self.splits[key[:3]]
            assert split is not None
            problem = replace(self._problem(replace(shape, microbatches=1, microbatch_size=self.profile.batch_size)),
                              microbatches=1)
            ranks = problem.stage_ranks
            floor = math.inf
            for level in self.shard_levels:
                problem = replace(problem, cost=self.cluster.cost_model(shape.replicas, optimizer=self.optimizer,
                                                                        shard=level))
                params: list[set[int]] = [set() for _ in range(problem.num_ranks)]
                for u, s in enumerate(split[0]):
                    params[ranks[s]].update(problem.unit_params[u])
                floor = min(floor, max(problem.dp_allreduce_ms(p) for p in params))
            self.dp_floor[key] = floor
        return self.dp_floor[key]

    def _problem(self, shape: _Shape) -> PartitionProblem:
        key = (shape.microbatch_size, shape.stages, shape.schedule, shape.virtual_stages)
        if key not in self.problems:
            if shape.microbatch_size not in self.scaled:
                self.scaled[shape.microbatch_size] = scale_profile(self.profile, shape.microbatch_size)
            self.problems[key] = build_problem(self.scaled[shape.microbatch_size], shape.stages,
                                               schedule=shape.schedule, virtual_stages=shape.virtual_stages)
        return self.problems[key]

    # -- pricing --------------------------------------------------------------

    def cutoff(self) -> float:
        return -self.heap[0][0] if len(self.heap) >= self.top else math.inf

    def run(self) -> None:
        """Price the shapes in order of their lower bound, first a coarse one (the model's compute
        spread evenly), then, when a shape comes up, its split's (``_bound``); stop at the cut-off."""
        queue = [(bound, i, False) for i, (bound, _) in enumerate(self.shapes)]
        heapq.heapify(queue)
        while queue:
            bound, i, refined = heapq.heappop(queue)
            shape = self.shapes[i][1]
            if bound > self.cutoff():
                for b, j, _ in [(bound, i, refined), *queue]:
                    for group in _groups(self.shapes[j][1])[:2]:
                        self.pruned[group] = min(self.pruned.get(group, b), b)
                return
            if not refined:
                split = self._split(shape.stages, shape.virtual_stages, shape.schedule)
                if split is not None:
                    heapq.heappush(queue, (self._bound(shape, *split[1:]), i, True))
                continue
            try:
                self._price(shape, bound)
            except (ScheduleError, PartitionError) as exc:
                self.notes.setdefault(_groups(shape)[1], f"cannot run some shapes: {exc}")

    def _price(self, shape: _Shape, bound: float) -> None:
        """Every sharding level of ``shape``: its memory per device (recomputing where it binds),
        and the simulated step of those that fit and can still beat the cut-off."""
        S, V, M = shape.stages, shape.virtual_stages, shape.microbatches
        kind = schedule_kind(shape.schedule)
        assignment = self._split(S, V, shape.schedule)[0]  # type: ignore[index]
        limit = self.cluster.device_memory
        base = self.cluster.cost_model(shape.replicas, optimizer=self.optimizer)
        problem = replace(self._problem(shape), microbatches=M, cost=base, memory_limit=limit)
        ev = evaluate(problem, assignment)
        self.priced += 1
        held = self._rank_params(problem, assignment)
        rest = [m - base.state_factor * p for m, p in zip(ev.rank_memory_bytes, held)]  # all but training state
        saved = [0.0] * problem.num_ranks  # what recomputing every stage of the rank saves
        for st in ev.stages:
            saved[st.rank] += st.activation_bytes - st.activation_bytes / st.in_flight
        for shard in self.shard_levels if shape.replicas > 1 else ("none",):
            cost = replace(base, shard=shard)
            memory = [r + cost.state_factor * p for r, p in zip(rest, held)]
            recompute: tuple[bool, ...] = ()
            if limit is not None and max(memory) > limit:
                if kind.split_backward:
                    self._note_memory(shape, shard, int(max(memory)))
                    continue
                over = {r for r, m in enumerate(memory) if m > limit}
                memory = [m - saved[r] if r in over else m for r, m in enumerate(memory)]
                if max(memory) > limit:
                    self._note_memory(shape, shard, int(max(memory)))
                    continue
                recompute = tuple(problem.stage_ranks[s] in over for s in range(problem.num_stages))
            priced = replace(problem, cost=replace(cost, recompute=recompute))
            overheads = step_overheads(priced, assignment, self.rt)
            if _pipeline_floor(shape, ev, recompute, kind.split_backward) + overheads.total_ms > self.cutoff():
                continue
            key = (shape, recompute)
            if key not in self.timelines:
                timed = evaluate(priced, assignment) if recompute else ev
                self.timelines[key] = simulate_plan(priced, assignment, self.rt, evaluation=timed)
                self.simulated += 1
            self._keep(self._score(shape, shard, recompute, self.timelines[key], overheads, int(max(memory)),
                                   assignment, [st.fwd_ms for st in ev.stages], problem.stage_ranks))

    def _rank_params(self, problem: PartitionProblem, assignment: tuple[int, ...]) -> list[int]:
        """Bytes of the distinct parameters each rank holds."""
        params: list[set[int]] = [set() for _ in range(problem.num_ranks)]
        for u, s in enumerate(assignment):
            params[problem.stage_ranks[s]].update(problem.unit_params[u])
        return [sum(problem.param_bytes[p] for p in ps) for ps in params]

    def _score(self, shape: _Shape, shard: str, recompute: tuple[bool, ...], line: Timeline,
               overheads: StepOverheads, memory: int, assignment: tuple[int, ...], fwd_ms: list[float],
               ranks: tuple[int, ...]) -> ConfigurationScore:
        step = line.step_ms + overheads.total_ms
        busy = max(line.busy_ms())
        extra = [0.0] * shape.stages
        for s, flag in enumerate(recompute):
            if flag:
                extra[ranks[s]] += shape.microbatches * fwd_ms[s]
        config = Configuration(shape.stages, shape.replicas, shape.microbatches, shape.microbatch_size,
                               shape.schedule, shape.virtual_stages, shard, recompute)
        parts = {"pipeline bubble": line.step_ms - busy, "data-parallel collectives": overheads.dp_all_reduce_ms,
                 "recompute": max(extra), "optimizer step": overheads.optimizer_ms}
        name, worst = max(parts.items(), key=lambda kv: kv[1])
        limit_text = f"{name} {_ms(worst)} ({worst / step:.0%} of the step)" if worst >= _MINOR * step else "compute"
        if recompute:
            limit_text += "; memory-bound (recomputes)"
        return ConfigurationScore(config=config, step_ms=step, samples_per_s=self.G / (step / 1e3),
                                  pipeline_ms=line.step_ms, bubble=line.bubble, peak_memory_bytes=memory,
                                  dp_ms=overheads.dp_all_reduce_ms, recompute_ms=max(extra), limit=limit_text,
                                  assignment=assignment)

    def _keep(self, score: ConfigurationScore) -> None:
        c = score.config
        for group in (("depth", str(c.stages)), ("schedule", c.schedule + (f" V={c.virtual_stages}"
                                                                           if c.virtual_stages > 1 else "")),
                      ("shard", c.shard)):
            old = self.by_group.get(group)
            if old is None or score.step_ms < old.step_ms:
                self.by_group[group] = score
        if len(self.heap) < self.top or score.step_ms < self.cutoff():
            self.best.append(score)
            heapq.heappush(self.heap, (-score.step_ms, len(self.best) - 1))
            if len(self.heap) > self.top:
                _, dropped = heapq.heappop(self.heap)
                self.best[dropped] = None  # type: ignore[call-overload]
            self.best = [s for s in self.best if s is not None]
            self.heap = [(-s.step_ms, i) for i, s in enumerate(self.best)]
            heapq.heapify(self.heap)

    def _note_memory(self, shape: _Shape, shard: str, need: int) -> None:
        for group in _groups(shape, shard):
            self.need[group] = min(self.need.get(group, need), need)

    # -- explanation ----------------------------------------------------------

    def _why_none(self, group: tuple[str, str]) -> str:
        """Why no configuration of ``group`` was priced: its lower bound, memory, or the schedule."""
        parts = []
        if group in self.pruned:
            parts.append(f"its least lower bound on the step ({_ms(self.pruned[group])}) is above the {self.top} best "
                         f"steps found (up to {_ms(self.cutoff())})")
        if group in self.need:
            limit = format_size(self.cluster.device_memory or 0)
            split = group[0] == "schedule" and schedule_kind(group[1].split()[0]).split_backward
            parts.append(f"what was priced needs {format_size(self.need[group])} on a device, over {limit}"
                         + (" (a split backward is not recomputed)" if split else " even recomputing"))
        if group in self.notes:
            parts.append(self.notes[group])
        return "; ".join(parts)

    def alternatives(self, best: ConfigurationScore) -> tuple[Alternative, ...]:
        out = []
        groups = sorted({*self.by_group, *self.notes, *self.need, *self.pruned},
                        key=lambda g: (g[0], int(g[1]) if g[0] == "depth" else 0, g[1]))
        for group, value in groups:
            score = self.by_group.get((group, value))
            if score is None:
                out.append(Alternative(group, value, None, self._why_none((group, value))))
            elif score.config == best.config:
                out.append(Alternative(group, value, score.step_ms, f"the best: {score.config.label}"))
            else:
                out.append(Alternative(group, value, score.step_ms, _why_slower(score, best)))
        return tuple(out)


def _groups(shape: _Shape, shard: str | None = None) -> list[tuple[str, str]]:
    """The explanation groups a shape belongs to: its depth, its schedule, its sharding level."""
    v = f" V={shape.virtual_stages}" if shape.virtual_stages > 1 else ""
    out = [("depth", str(shape.stages)), ("schedule", shape.schedule + v)]
    return out + [("shard", shard)] if shard is not None else out


def _pipeline_floor(shape: _Shape, ev: Evaluation, recompute: tuple[bool, ...], split_backward: bool) -> float:
    """``_Search._bound``'s pipeline part from the priced stages, recomputation included."""
    busy = [0.0] * shape.stages
    for s, st in enumerate(ev.stages):
        busy[st.rank] += st.compute_ms + (st.fwd_ms if recompute and recompute[s] else 0.0)
    tail = shape.virtual_stages == 1 and not split_backward
    best = before_f = before_b = 0.0
    for r in range(shape.stages):
        best = max(best, before_f + shape.microbatches * busy[r] + (before_b if tail else 0.0))
        before_f += ev.stages[r].fwd_ms
        before_b += ev.stages[r].bwd_ms
    return best


def _why_slower(score: ConfigurationScore, best: ConfigurationScore) -> str:
    """Where ``score``'s step loses to ``best``'s, the largest difference first."""
    ratio = score.step_ms / best.step_ms if best.step_ms > 0 else 1.0
    compute = (score.pipeline_ms * (1 - score.bubble) - score.recompute_ms) - \
              (best.pipeline_ms * (1 - best.bubble) - best.recompute_ms)
    diffs = {"bubble": score.pipeline_ms * score.bubble - best.pipeline_ms * best.bubble,
             "data-parallel collectives": score.dp_ms - best.dp_ms,
             "recompute": score.recompute_ms - best.recompute_ms,
             "compute per device": compute}
    losses = [f"{k} +{_ms(v)}" for k, v in sorted(diffs.items(), key=lambda kv: -kv[1]) if v > 0.01 * best.step_ms]
    return f"{ratio:.2f}x the best step ({score.config.label}): " + (", ".join(losses[:3]) or "slightly slower")


def _nothing_fits(search: _Search, cluster: ClusterSpec) -> str:
    limit = cluster.device_memory
    least = min((n for (g, _), n in search.need.items() if g == "depth"), default=None)
    if limit is not None and least is not None:
        return (f"no configuration fits {format_size(limit)} per device on {cluster.devices} devices: the least any "
                f"needs is {format_size(least)} (with the sharding levels tried, recomputing); add devices or memory, or lower the "
                "global batch")
    return f"no configuration could be planned on {cluster.devices} devices; check the global batch and schedules"


def _ms(ms: float) -> str:
    return f"{ms / 1e3:.3g} s" if ms >= 1e3 else f"{ms:.3g} ms"


def plan_configuration(profile: ModelProfile, cluster: ClusterSpec, config: Configuration, *, optimizer: str = "adam",
                       time_limit: float = 10.0) -> PartitionPlan:
    """The plan of one searched configuration: ``plan_partition`` at its microbatch size, with its
    replicas, sharding, recomputed stages and the cluster's links and device memory."""
    from fxpipe.partitioner.planner import plan_partition

    cost = cluster.cost_model(config.replicas, optimizer=optimizer, shard=config.shard, recompute=config.recompute)
    return plan_partition(scale_profile(profile, config.microbatch_size), config.stages, schedule=config.schedule,
                          microbatches=config.microbatches, cost=cost, memory_limit=cluster.device_memory,
                          time_limit=time_limit, virtual_stages=config.virtual_stages)
