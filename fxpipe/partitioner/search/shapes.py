"""The shapes a cluster search tries (S x R x M x schedule), their compute-balanced splits and lower bounds.

A shape is everything of a configuration but the sharding level and the recomputed
stages (Note [cluster search] in ``search``). Its units are split into S x V stages by
``SplitCache``: one compute-balanced split per chunk count (the exact chain DP), placed
on the ranks loop- or V-style; the bounds here need only that split's per-rank compute.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fxpipe.errors import PartitionError, ScheduleError
from fxpipe.partitioner.cluster import ClusterSpec
from fxpipe.partitioner.solve.dp import solve_chain_dp
from fxpipe.partitioner.problem import build_problem
from fxpipe.partitioner.schedule import schedule_kind, stage_ranks
from fxpipe.tracer.profile import ModelProfile, TensorSpec

__all__ = [
    "Shape",
    "Split",
    "SplitCache",
    "scale_profile",
    "enumerate_shapes",
    "pipeline_floor",
    "runnable_shard_levels",
    "least_bottleneck",
]


@dataclass(frozen=True)
class Shape:
    """S pipeline ranks x R replicas, M microbatches of ``microbatch_size`` samples, a schedule on V stages per rank."""

    stages: int
    replicas: int
    microbatches: int
    microbatch_size: int
    schedule: str
    virtual_stages: int

    @property
    def placement(self) -> str:
        return schedule_kind(self.schedule).placement if self.virtual_stages > 1 else "loop"

    @property
    def split_backward(self) -> bool:
        return schedule_kind(self.schedule).split_backward


@dataclass(frozen=True)
class Split:
    """A split of the units into S x V stages (``assignment``: stage of each unit), and per
    rank at the traced batch: its compute (``rank_ms``), and its first stage's forward and backward."""

    assignment: tuple[int, ...]
    rank_ms: tuple[float, ...]
    first_fwd_ms: tuple[float, ...]
    first_bwd_ms: tuple[float, ...]


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

    units = tuple(
        replace(
            u,
            fwd_ms=u.fwd_ms * r,
            bwd_ms=u.bwd_ms * r,
            fwd_flops=u.fwd_flops * r,
            activation_bytes=round(u.activation_bytes * r),
            outputs=tuple(spec(o) for o in u.outputs),
        )
        for u in profile.units
    )
    edges = tuple(replace(e, bytes=round(e.bytes * r)) for e in profile.edges)
    return replace(
        profile,
        units=units,
        edges=edges,
        batch_size=batch,
        inputs=tuple(spec(s) for s in profile.inputs),
    )


def enumerate_shapes(
    units: int, devices: int, global_batch: int, kinds: list[tuple[str, int]], depths: range
) -> list[Shape]:
    """Every shape of the search: for each depth S, the most replicas R <= devices / S that divide the
    global batch (fewer only lengthen the step), every M dividing G / R, every schedule that fits.
    A 1-stage pipeline has no bubble to schedule: it gets one schedule (``_unpipelined``), not every
    schedule's variant of the same step."""
    shapes: list[Shape] = []
    for S in depths:
        R = max(r for r in range(1, devices // S + 1) if global_batch % r == 0)
        per_replica = global_batch // R
        fitting = [(name, V) for name, V in kinds if S * V <= units]
        if S == 1:
            fitting = _unpipelined(fitting)
        for M in (m for m in range(1, per_replica + 1) if per_replica % m == 0):
            shapes.extend(Shape(S, R, M, per_replica // M, name, V) for name, V in fitting)
    return shapes


def _unpipelined(kinds: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The one schedule a 1-stage pipeline runs: 1F1B (one microbatch in flight, the least memory of
    the same step), else the first of ``kinds`` with one stage per rank and a fused backward."""
    plain = [(n, v) for n, v in kinds if v == 1 and not schedule_kind(n).split_backward]
    return [k for k in plain if k[0] == "1f1b"][:1] or plain[:1] or kinds[:1]


def runnable_shard_levels(shape: Shape, levels: tuple[str, ...]) -> tuple[str, ...]:
    """The sharding levels the runtime runs on ``shape``: ``none`` with one replica, else every
    level of ``levels``: FSDP's shard each chunk of a rank on its own and, under a schedule that
    splits the backward, reduce after the step's last W (Note [sharding in a pipeline] in
    ``fxpipe.runtime.dataparallel.sharded``)."""
    if shape.replicas == 1:
        return ("none",)
    return levels


class SplitCache:
    """The compute-balanced split of ``profile`` into each chunk count (one per count: the exact chain
    DP over the units' compute and messages), and its per-rank figures under each placement."""

    def __init__(self, profile: ModelProfile, cluster: ClusterSpec) -> None:
        self.profile, self.cluster = profile, cluster
        self._chunks: dict[int, tuple[int, ...] | None] = {}
        self._splits: dict[tuple[int, int, str], Split | None] = {}

    def chunks(self, count: int) -> tuple[int, ...] | None:
        """The stage of each unit in the balanced split into ``count`` contiguous stages (``None``:
        none exists). The same split serves every S x V = count: a rank's V chunks are balanced
        when each chunk is, and the DP's messages are small beside the compute."""
        if count not in self._chunks:
            try:
                problem = build_problem(self.profile, count, cost=self.cluster.cost_model())
                self._chunks[count] = solve_chain_dp(problem).assignment
            except (PartitionError, ScheduleError):
                self._chunks[count] = None
        return self._chunks[count]

    def split(self, S: int, V: int, placement: str) -> Split | None:
        """``chunks(S x V)`` placed on S ranks, with its per-rank compute at the traced batch."""
        key = (S, V, placement)
        if key not in self._splits:
            chunks = self.chunks(S * V)
            if chunks is None:
                self._splits[key] = None
                return None
            ranks = stage_ranks(S, V, placement)
            rank_ms, fwd, bwd = [0.0] * S, [0.0] * S, [0.0] * S
            for u, s in enumerate(chunks):
                unit = self.profile.units[u]
                rank_ms[ranks[s]] += unit.fwd_ms + unit.bwd_ms
                if s < S:  # rank s's first stage, under both placements
                    fwd[s] += unit.fwd_ms
                    bwd[s] += unit.bwd_ms
            self._splits[key] = Split(chunks, tuple(rank_ms), tuple(fwd), tuple(bwd))
        return self._splits[key]


def pipeline_floor(
    microbatches: int,
    busy_ms: list[float] | tuple[float, ...],
    first_fwd_ms: list[float] | tuple[float, ...],
    first_bwd_ms: list[float] | tuple[float, ...],
    tail: bool,
) -> float:
    """A lower bound on a pipeline's forward/backward part: rank r cannot start before microbatch 0
    has passed the ranks before it, then computes M x its ``busy_ms``; with ``tail`` (a fused
    backward on loop-placed stages) the last gradient must then pass back through the ranks before it."""
    best = before_f = before_b = 0.0
    for r, busy in enumerate(busy_ms):
        best = max(best, before_f + microbatches * busy + (before_b if tail else 0.0))
        before_f += first_fwd_ms[r]
        before_b += first_bwd_ms[r]
    return best


def least_bottleneck(compute_ms: list[float] | tuple[float, ...], count: int) -> float:
    """A lower bound (within 1e-9 of it, from below) on the largest part's sum over every split of
    ``compute_ms`` into ``count`` contiguous parts: bisection on the cap with a greedy check, no
    split built. The search bounds a shape by it before the split's DP is solved."""
    lo, hi = max(max(compute_ms), sum(compute_ms) / count), sum(compute_ms)
    if count <= 1 or lo >= hi:
        return hi if count <= 1 else lo
    while hi - lo > 1e-9 * hi:
        cap = (lo + hi) / 2
        parts, run = 1, 0.0
        for c in compute_ms:
            if run + c > cap:
                parts, run = parts + 1, c
            else:
                run += c
        if parts <= count:
            hi = cap
        else:
            lo = cap
    return lo * (1 - 1e-9)  # below the float sums' rounding too
