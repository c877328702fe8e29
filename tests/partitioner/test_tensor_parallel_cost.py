"""Pricing tensor parallelism (fxpipe.partitioner.tensor_parallel) on a literal profile."""

from __future__ import annotations

import math

import pytest

from fxpipe.errors import ConfigError
from fxpipe.partitioner.tensor_parallel import (
    allreduce_ms,
    tensor_parallel_profile,
    tensor_parallel_tradeoff,
)
from fxpipe.tracer.profile import ModelProfile, TensorSpec, Unit


def _profile() -> ModelProfile:
    out = (TensorSpec((2, 16, 32)),)  # 4 KiB of float32
    units = (
        Unit("norm", "norm", outputs=out, fwd_ms=1.0, bwd_ms=2.0, param_bytes=128, params=("norm.weight",)),
        Unit("attn.q", "attn.q", outputs=out, fwd_ms=4.0, bwd_ms=8.0, param_bytes=4096, params=("attn.q.weight",)),
        Unit("attn", "attn", outputs=out, fwd_ms=2.0, bwd_ms=4.0, activation_bytes=400),
        Unit("attn.o", "attn.o", outputs=out, fwd_ms=4.0, bwd_ms=8.0, param_bytes=4096, params=("attn.o.weight",)),
    )  # fmt: skip
    sizes = {"norm.weight": 128, "attn.q.weight": 4096, "attn.o.weight": 4096}
    return ModelProfile(units=units, edges=(), batch_size=2, param_sizes=sizes)


STYLES = {"attn.q": "colwise", "attn.o": "rowwise"}


def test_split_units_take_a_share_and_the_rowwise_one_pays_the_all_reduces() -> None:
    tp = tensor_parallel_profile(_profile(), STYLES, 4, bandwidth=1e9, latency=1e-5)
    by = {u.name: u for u in tp.units}
    ar = allreduce_ms(4096, 4, 1e9, 1e-5)  # 2*3/4*4096/1e9 s + 6*10 us = 0.066144 ms
    assert ar == pytest.approx(0.066144)
    assert (by["norm"].fwd_ms, by["norm"].param_bytes) == (1.0, 128)  # replicated: whole
    assert (by["attn.q"].fwd_ms, by["attn.q"].bwd_ms, by["attn.q"].param_bytes) == (1.0, 2.0, 1024)
    assert (by["attn"].fwd_ms, by["attn"].activation_bytes) == (0.5, 100)  # heads split too
    assert by["attn.o"].fwd_ms == pytest.approx(1.0 + ar)
    assert by["attn.o"].bwd_ms == pytest.approx(2.0 + ar)
    assert tp.param_sizes == {"norm.weight": 128, "attn.q.weight": 1024, "attn.o.weight": 1024}
    assert tensor_parallel_profile(_profile(), STYLES, 1, 1e9, 1e-5) == _profile()


def test_tradeoff_says_when_tp_loses() -> None:
    fast = tensor_parallel_tradeoff(_profile(), {2: STYLES, 4: STYLES}, 1e9, 1e-5, (1, 2, 4))
    assert [c.degree for c in fast] == [1, 2, 4]
    assert fast[0].compute_ms == pytest.approx(33.0) and fast[0].comm_ms == 0
    assert fast[2].saved_ms == pytest.approx(30 * 3 / 4)  # 30 ms of split work, 3/4 saved
    assert not fast[2].loses and "TP wins" in fast[2].explain()
    slow = tensor_parallel_tradeoff(_profile(), {2: STYLES}, 1e3, 1e-5, (2,))  # a 1 kB/s link
    assert slow[0].loses and "TP loses" in slow[0].explain()
    nothing = tensor_parallel_tradeoff(_profile(), {}, 1e9, 1e-5, (2,))  # nothing split
    assert nothing[0].loses and nothing[0].saved_ms == pytest.approx(0.0)
    with pytest.raises(ConfigError, match="colwise or rowwise"):
        tensor_parallel_profile(_profile(), {"attn.q": "diagonal"}, 2, 1e9, 1e-5)


def _llama_styles(layers: int) -> dict[str, str]:
    styles = {}
    for i in range(layers):
        for name, style in (("attn.wq", "colwise"), ("attn.wk", "colwise"), ("attn.wv", "colwise"),
                            ("attn.wo", "rowwise"), ("mlp.w1", "colwise"), ("mlp.w3", "colwise"),
                            ("mlp.w2", "rowwise")):  # fmt: skip
            styles[f"layers.{i}.{name}"] = style
    return styles


def test_the_cluster_search_picks_a_degree_and_says_why_the_others_lose() -> None:
    """An 8-block Llama-8B-shaped model on 16 GPUs in nodes of 8: every degree that divides a
    node is searched as devices / T groups and priced, the fastest is best and the others say
    they lose and by how much; on a 1 MB/s intra-node link tp 1 wins."""
    from fxpipe.partitioner.cluster import ClusterSpec
    from fxpipe.partitioner.search.tensor_parallel import search_tensor_parallel
    from fxpipe.partitioner.synthetic import transformer_profile

    profile = transformer_profile(
        layers=8, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=32000, seq=2048
    )
    styles = _llama_styles(8)
    at = {2: styles, 4: styles, 8: styles}
    fast = ClusterSpec(devices=16, device_memory=80 * 2**30, node_size=8)
    best, outcomes = search_tensor_parallel(profile, fast, 64, at, (1, 2, 4, 8, 16), top=1)
    assert [o.degree for o in outcomes if o.result is None] == [16]  # 16 does not divide a node
    assert "does not divide a node of 8" in outcomes[-1].note
    assert best.note.startswith(f"tp {best.degree}: best")
    assert all("loses" in o.note for o in outcomes if o.result is not None and o is not best)
    tp = [o for o in outcomes if o.result is not None and o.degree > 1]
    assert tp and all(o.result.best.config.devices * o.degree == 16 for o in tp)
    slow = ClusterSpec(
        devices=16,
        device_memory=80 * 2**30,
        node_size=8,
        intra_link="custom",
        intra_bandwidth=1e6,  # 1 MB/s: every all-reduce costs seconds
        intra_latency=1e-3,
    )
    best_slow, _ = search_tensor_parallel(profile, slow, 64, at, (1, 2, 4), top=1)
    assert best_slow.degree == 1


def test_each_split_pair_pays_the_runtimes_cost_per_pair() -> None:
    """Note [tensor-parallel runtime cost]: the rowwise linear of each pair carries the runtime's
    (forward, backward) cost per microbatch beyond the all-reduces' link time, and the tradeoff
    counts it with them; the CPU runtime's figure is measured, the CUDA one 0."""
    from fxpipe.partitioner.prediction import RUNTIME_COSTS

    tp = tensor_parallel_profile(_profile(), STYLES, 2, 1e9, 1e-5, pair_ms=(1.5, 3.0))
    ar = allreduce_ms(4096, 2, 1e9, 1e-5)
    by = {u.name: u for u in tp.units}
    assert by["attn.o"].fwd_ms == pytest.approx(2.0 + ar + 1.5)
    assert by["attn.o"].bwd_ms == pytest.approx(4.0 + ar + 3.0)
    assert by["attn.q"].fwd_ms == pytest.approx(2.0)  # the colwise half carries none of it
    cost = tensor_parallel_tradeoff(_profile(), {2: STYLES}, 1e9, 1e-5, (2,), pair_ms=(1.5, 3.0))
    assert cost[0].comm_ms == pytest.approx(2 * ar + 4.5)
    assert cost[0].saved_ms == pytest.approx(15.0)  # the split work's half: unchanged
    cpu, cuda = RUNTIME_COSTS["cpu"], RUNTIME_COSTS["cuda"]
    assert cpu.tp_pair_fwd_ms > 0 and cpu.tp_pair_bwd_ms > 0
    assert (cuda.tp_pair_fwd_ms, cuda.tp_pair_bwd_ms) == (0.0, 0.0)


def test_the_search_prices_the_runtimes_pair_cost() -> None:
    """The cluster search charges the pair cost of the runtime it prices with: a cost per pair
    larger than the compute TP saves makes tp 1 the best degree where, without it, TP wins."""
    from dataclasses import replace

    from fxpipe.partitioner.cluster import ClusterSpec
    from fxpipe.partitioner.prediction import RUNTIME_COSTS
    from fxpipe.partitioner.search.tensor_parallel import search_tensor_parallel
    from fxpipe.partitioner.synthetic import transformer_profile

    profile = transformer_profile(
        layers=8, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=32000, seq=2048
    )
    styles = _llama_styles(8)
    cluster = ClusterSpec(devices=8, device_memory=80 * 2**30, node_size=8)
    free = RUNTIME_COSTS["cuda"]
    best, _ = search_tensor_parallel(profile, cluster, 4, {2: styles}, (1, 2), top=1, runtime=free)
    assert best.degree == 2
    dear = replace(free, tp_pair_fwd_ms=1e4, tp_pair_bwd_ms=1e4)  # 10 s per pair
    best, outcomes = search_tensor_parallel(
        profile, cluster, 4, {2: styles}, (1, 2), top=1, runtime=dear
    )
    assert best.degree == 1 and "tp 2: loses" in outcomes[1].note


def test_memory_is_the_ranks_shards_and_fsdp_shards_them_again() -> None:
    """Note [memory of tensor-parallel shards]: a split parameter's bytes and shape are its
    local shard's (colwise and vocabulary-parallel: dim 0 / T; rowwise: dim 1 / T; a rowwise
    bias replicated), so FSDP over TP (--tp 2 --shard full, R replicas) is priced on the shards:
    memory P_split / (T R) + P_replicated / R, and FSDP's padding of the local dim 0."""
    from fxpipe.partitioner.cost import CostModel

    out = (TensorSpec((2, 16, 32)),)
    shapes = {
        "embed.weight": (64, 32),
        "fc.weight": (10, 32),  # dim 0: 10 whole, 5 a tp shard, padded to 8 over R = 4
        "fc.bias": (10,),
        "proj.weight": (32, 10),
        "proj.bias": (32,),
        "norm.weight": (32,),
    }
    sizes = {k: 4 * math.prod(v) for k, v in shapes.items()}
    units = tuple(
        Unit(m, m, outputs=out, fwd_ms=1.0, bwd_ms=1.0, param_bytes=sum(
            b for k, b in sizes.items() if k.startswith(m + ".")
        ), params=tuple(k for k in sizes if k.startswith(m + ".")))
        for m in ("embed", "fc", "proj", "norm")
    )  # fmt: skip
    profile = ModelProfile(
        units=units, edges=(), batch_size=2, param_sizes=sizes, param_shapes=shapes
    )
    styles = {"embed": "vocab_embedding", "fc": "colwise", "proj": "rowwise"}
    tp = tensor_parallel_profile(profile, styles, 2, 1e9, 1e-5)
    assert tp.param_shapes == {
        "embed.weight": (32, 32),
        "fc.weight": (5, 32),
        "fc.bias": (5,),
        "proj.weight": (32, 5),
        "proj.bias": (32,),  # RowwiseParallel replicates the bias
        "norm.weight": (32,),
    }
    assert tp.param_sizes == {k: 4 * math.prod(v) for k, v in tp.param_shapes.items()}
    by = {u.name: u for u in tp.units}
    assert by["embed"].param_bytes == 4 * 32 * 32 and by["embed"].fwd_ms == 1.0  # memory only
    assert by["proj"].param_bytes == 4 * (32 * 5 + 32)
    assert sum(u.param_bytes for u in tp.units) == sum(tp.param_sizes.values())
    full = CostModel(dp_replicas=4, shard="full")
    total = sum(tp.param_sizes.values())
    assert full.stage_state_bytes(total)[0] == round(total / 4)
    names = list(tp.param_sizes)
    traffic = full.shard_traffic(
        [tp.param_sizes[n] for n in names], [tp.param_shapes[n] for n in names]
    )
    padded = {"embed.weight": 32 * 32, "fc.weight": 8 * 32, "fc.bias": 8, "proj.weight": 32 * 5}
    padded |= {"proj.bias": 32, "norm.weight": 32}  # dim 0 to a multiple of 4, as FSDP2 pads
    assert traffic.reduce_scatter_bytes == pytest.approx(4 * sum(padded.values()))
