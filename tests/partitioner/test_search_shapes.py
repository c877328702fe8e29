"""The cluster search's shapes: one compute-balanced split per chunk count, its placement on the
ranks, the sharding levels the runtime runs, and a fixed pipeline depth."""

from __future__ import annotations

import itertools

import pytest

from fxpipe.errors import ConfigError
from fxpipe.partitioner.cluster import ClusterSpec
from fxpipe.partitioner.prediction import RUNTIME_COSTS
from fxpipe.partitioner.problem import build_problem, evaluate
from fxpipe.partitioner.search.configurations import search_configurations
from fxpipe.partitioner.search.shapes import (
    Shape,
    SplitCache,
    enumerate_shapes,
    runnable_shard_levels,
)
from fxpipe.partitioner.synthetic import transformer_profile


WORKSPACE = RUNTIME_COSTS["cuda"].workspace_bytes  # every CUDA rank's cuBLAS workspaces


def _device(mib: float) -> int:
    """A toy device's memory: the libraries' workspace plus ``mib`` MiB for the model."""
    return WORKSPACE + int(mib * 2**20)


def _small(layers: int = 5):
    return transformer_profile(
        layers=layers,
        hidden=128,
        ffn=512,
        heads=4,
        kv_heads=2,
        vocab=512,
        seq=512,
        device_tflops=0.05,
    )


def _contiguous_splits(units: int, count: int):
    for cuts in itertools.combinations(range(1, units), count - 1):
        bounds = (0, *cuts, units)
        yield tuple(s for s in range(count) for _ in range(bounds[s], bounds[s + 1]))


def test_each_chunk_count_gets_its_own_balanced_split() -> None:
    profile = _small()
    cluster = ClusterSpec(devices=8, node_size=4)
    cache = SplitCache(profile, cluster)
    n = len(profile.units)
    seen = set()
    for count in range(1, n + 1):
        chunks = cache.chunks(count)
        assert chunks is not None and sorted(set(chunks)) == list(range(count))
        assert list(chunks) == sorted(chunks)  # contiguous, in order
        problem = build_problem(profile, count, cost=cluster.cost_model())
        best = min(evaluate(problem, a).bottleneck_ms for a in _contiguous_splits(n, count))
        assert evaluate(problem, chunks).bottleneck_ms == pytest.approx(
            best
        )  # brute force: no better split
        seen.add(chunks)
    assert len(seen) == n  # a split per count, never one reused for another count
    assert cache.chunks(n + 1) is None


def test_a_split_is_placed_on_the_ranks_as_its_schedule_places_it() -> None:
    profile = _small()
    cache = SplitCache(profile, ClusterSpec(devices=8))
    compute = [u.fwd_ms + u.bwd_ms for u in profile.units]
    chunks = cache.chunks(4)
    per_chunk = [sum(c for c, s in zip(compute, chunks) if s == k) for k in range(4)]
    loop, v = cache.split(2, 2, "loop"), cache.split(2, 2, "v")
    assert (
        loop is not None
        and v is not None
        and loop.assignment == v.assignment == cache.split(4, 1, "loop").assignment
    )
    assert loop.rank_ms == pytest.approx((per_chunk[0] + per_chunk[2], per_chunk[1] + per_chunk[3]))
    assert v.rank_ms == pytest.approx((per_chunk[0] + per_chunk[3], per_chunk[1] + per_chunk[2]))


def test_fsdp_levels_wherever_the_runtime_runs_them() -> None:
    """Every level with 2+ replicas, chunked and split-backward schedules included (FSDP per chunk,
    reduced after the last W: tests/runtime/dataparallel/test_sharded_chunks.py); none with one."""
    levels = ("none", "optimizer", "grad-op", "full")
    for name, v in (("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("zbv", 2)):
        assert runnable_shard_levels(Shape(2, 2, 4, 1, name, v), levels) == levels
        assert runnable_shard_levels(Shape(2, 1, 4, 1, name, v), levels) == ("none",)
    result = search_configurations(
        _small(6), ClusterSpec(devices=8, device_memory=_device(20), node_size=4), 16, top=10**6
    )
    configs = [s.config for s in result.ranked]
    sharded = [c for c in configs if c.shard in ("grad-op", "full")]
    assert all(c.replicas > 1 for c in sharded)
    assert any(c.virtual_stages > 1 for c in sharded)
    assert all(c.shard == "none" for c in configs if c.replicas == 1)


def test_a_fixed_depth_searches_the_replicas_and_the_rest() -> None:
    shapes = enumerate_shapes(7, 4, 8, [("1f1b", 1), ("interleaved-1f1b", 2)], range(2, 3))
    assert {(s.stages, s.replicas) for s in shapes} == {(2, 2)}
    assert {(s.microbatches, s.microbatch_size) for s in shapes} == {(1, 4), (2, 2), (4, 1)}
    result = search_configurations(_small(), ClusterSpec(devices=4), 8, stages=2, top=10**6)
    assert {(s.config.stages, s.config.replicas) for s in result.ranked} == {(2, 2)}
    with pytest.raises(ConfigError, match=r"--stages 5 with --devices 4: the depth must be 1\.\.4"):
        search_configurations(_small(), ClusterSpec(devices=4), 8, stages=5)


def test_the_bound_is_below_every_priced_step() -> None:
    """The lower bound that orders and prunes the shapes (the fill, M x the busiest rank, the drain
    back through the ranks before it under a fused backward on loop-placed stages, the least step
    overheads) is at most the simulated step of every configuration of the shape, every schedule."""
    from fxpipe.partitioner.prediction import RUNTIME_COSTS
    from fxpipe.partitioner.search.pricing import Pricer

    profile = _small(6)
    cluster = ClusterSpec(devices=8, device_memory=_device(20), node_size=4)
    result = search_configurations(profile, cluster, 16, top=10**6)
    pricer = Pricer(
        profile, cluster, 16, "adam", ("none", "optimizer", "grad-op", "full"), RUNTIME_COSTS["cpu"]
    )
    splits = SplitCache(profile, cluster)
    assert {s.config.schedule for s in result.ranked} >= {"gpipe", "1f1b", "interleaved-1f1b"}
    for score in result.ranked:
        c = score.config
        shape = Shape(
            c.stages, c.replicas, c.microbatches, c.microbatch_size, c.schedule, c.virtual_stages
        )
        split = splits.split(shape.stages, shape.virtual_stages, shape.placement)
        assert split is not None
        assert pricer.bound(shape, split) <= score.step_ms * (1 + 1e-9), c.label


def test_least_bottleneck_is_the_brute_force_one_from_below() -> None:
    from fxpipe.partitioner.search.shapes import least_bottleneck

    for values in ([3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0], [1.0] * 7, [10.0, 0.5, 0.5, 0.5, 8.0]):
        for count in range(1, len(values) + 1):
            best = min(
                max(sum(values[a:b]) for a, b in zip((0, *cuts), (*cuts, len(values))))
                for cuts in itertools.combinations(range(1, len(values)), count - 1)
            )
            got = least_bottleneck(values, count)
            assert got <= best and got == pytest.approx(best, rel=1e-8), (values, count)


def test_the_coarse_bound_is_below_the_splits_bound() -> None:
    """Shapes are first ordered by a bound without a split; it must not exceed the split's bound."""
    from fxpipe.partitioner.solve.auto import auto_candidates
    from fxpipe.partitioner.prediction import RUNTIME_COSTS
    from fxpipe.partitioner.search.configurations import _Search

    profile = _small(6)
    cluster = ClusterSpec(devices=8, device_memory=_device(20), node_size=4)
    search = _Search(
        profile,
        cluster,
        16,
        "adam",
        ("none", "optimizer", "grad-op", "full"),
        5,
        RUNTIME_COSTS["cpu"],
    )
    shapes = enumerate_shapes(len(profile.units), 8, 16, list(auto_candidates()), range(1, 9))
    assert len(shapes) > 50
    for shape in shapes:
        split = search.splits.split(shape.stages, shape.virtual_stages, shape.placement)
        if split is not None:
            assert search._coarse_bound(shape) <= search.pricer.bound(shape, split), shape
