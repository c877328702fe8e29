"""Data-parallel hook pricing (Note [hook pricing] in fxpipe.partitioner.cost) with literal answers."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from fxpipe.errors import ConfigError, PartitionError
from fxpipe.partitioner import CostModel
from fxpipe.partitioner.cost import ddp_buckets
from fxpipe.partitioner.problem import build_problem, evaluate
from fxpipe.tracer import trace_model
from fxpipe.tracer.profile import ModelProfile, Unit

MiB = 2**20
# 1 GB/s, 0.1 ms a message, 2 replicas: an all-reduce of B bytes costs B / 1e6 ms + 2 ring hops x 0.1 ms.
LINK = CostModel(link_bandwidth=1e9, link_latency=1e-4, dp_replicas=2)
PSGD4 = replace(LINK, comm_hook="powersgd", powersgd_rank=4)


def test_linear_weight_is_compressed_and_its_bias_sent_whole() -> None:
    traffic = PSGD4.dp_traffic([4_000_000, 4_000], [(1000, 1000), (1000,)])
    assert traffic.wire_bytes == (1000 + 1000) * 4 * 4 + 4000
    assert traffic.allreduces == 3  # uncompressed tensors, P, Q
    assert PSGD4.allreduce_ms([4_000_000, 4_000], [(1000, 1000), (1000,)]) == pytest.approx(
        0.036 + 0.6
    )
    assert LINK.allreduce_ms([4_000_000, 4_000], [(1000, 1000), (1000,)]) == pytest.approx(
        4.004 + 0.2
    )


def test_embedding_matrix_at_rank_one() -> None:
    psgd1 = replace(PSGD4, powersgd_rank=1)
    assert psgd1.gradient_bytes(50257 * 768 * 4, (50257, 768)) == (50257 + 768) * 4


def test_nd_tensors_use_the_first_dimension_and_small_matrices_stay_whole() -> None:
    assert (
        PSGD4.gradient_bytes(64 * 27 * 4, (64, 3, 3, 3)) == (64 + 27) * 4 * 4
    )  # conv weight as 64 x 27
    assert (
        PSGD4.gradient_bytes(8 * 8 * 4, (8, 8)) == 8 * 8 * 4
    )  # (8 + 8) x 4 x 2 >= 64: not worth it
    assert PSGD4.gradient_bytes(12 * 4, (4, 3)) == 12 * 4  # rank clipped to 3, still no saving
    assert PSGD4.gradient_bytes(4, ()) == 4  # a 0-d tensor has no matrix view
    assert replace(PSGD4, comm_hook="fp16").gradient_bytes(4000, (1000,)) == 2000


def test_buckets_fill_in_reverse_order_and_each_costs_its_all_reduces() -> None:
    assert ddp_buckets([30 * MiB, MiB, 20 * MiB, 10 * MiB], 25 * MiB) == [[3, 2], [1, 0]]
    sizes = [30 * MiB, 4000]
    assert (
        PSGD4.dp_traffic(sizes, [(7680, 1024), (1000,)]).allreduces == 3
    )  # one bucket: 30 MiB + bias
    assert (
        replace(PSGD4, dp_bucket_bytes=4000).dp_traffic(sizes, [(7680, 1024), (1000,)]).allreduces
        == 6
    )
    assert replace(LINK, dp_bucket_bytes=4000).dp_traffic(sizes).allreduces == 2
    with pytest.raises(ConfigError, match="dp_bucket_bytes must be an int >= 1, got 0"):
        CostModel(dp_bucket_bytes=0)
    with pytest.raises(PartitionError, match="1 parameter shapes given for 2 parameters"):
        PSGD4.dp_traffic(sizes, [(1000,)])


def test_batched_powersgd_compresses_each_bucket_as_a_padded_square() -> None:
    batched = replace(LINK, comm_hook="batched_powersgd", powersgd_rank=1)
    traffic = batched.dp_traffic([4_000_000, 4_000])  # 1 001 000 numbers -> side 1001
    assert traffic.wire_bytes == 2 * 1001 * 4 and traffic.allreduces == 2


def _linear_profile(shapes: dict[str, tuple[int, ...]]) -> ModelProfile:
    units = (
        Unit(
            name="fc",
            module_path="fc",
            params=("fc.weight", "fc.bias"),
            param_bytes=4_004_000,
            fwd_ms=1.0,
        ),
        Unit(
            name="head", module_path="head", params=("head.weight",), param_bytes=4_000, fwd_ms=1.0
        ),
    )
    sizes = {"fc.weight": 4_000_000, "fc.bias": 4_000, "head.weight": 4_000}
    return ModelProfile(units=units, edges=(), batch_size=1, param_sizes=sizes, param_shapes=shapes)


def test_stage_all_reduce_prices_the_stage_own_shapes() -> None:
    profile = _linear_profile(
        {"fc.weight": (1000, 1000), "fc.bias": (1000,), "head.weight": (1, 1000)}
    )
    stages = evaluate(build_problem(profile, 2, cost=PSGD4), (0, 1)).stages
    assert [s.dp_allreduce_ms for s in stages] == pytest.approx([0.036 + 0.6, 0.004 + 0.6])
    assert ModelProfile.from_json(profile.to_json()) == profile


def test_a_profile_without_shapes_falls_back_to_square_matrices() -> None:
    old = _linear_profile({}).to_dict()
    del old["param_shapes"]
    profile = ModelProfile.from_dict(old)
    assert profile.param_shapes == {}
    stages = evaluate(build_problem(profile, 2, cost=PSGD4), (0, 1)).stages
    square_bias = 2 * math.sqrt(1000) * 4 * 4  # 1000 numbers as a 31.6 x 31.6 matrix
    expected = [(2000 * 4 * 4 + square_bias) / 1e6 + 0.6, square_bias / 1e6 + 0.6]
    assert [s.dp_allreduce_ms for s in stages] == pytest.approx(expected)


def test_tracer_records_parameter_shapes() -> None:
    model = nn.Sequential(nn.Linear(8, 4), nn.LayerNorm(4))
    profile = trace_model(model, (torch.randn(2, 8),), progress=False).profile
    assert profile.param_shapes == {
        "0.weight": (4, 8),
        "0.bias": (4,),
        "1.weight": (4,),
        "1.bias": (4,),
    }


@pytest.mark.parametrize("replicas", [2, 4, 8])
def test_latency_is_paid_once_per_ring_hop(replicas: int) -> None:
    # latency only (bandwidth so high that bytes cost nothing): an all-reduce is 2(R-1) hops,
    # a sharded step's all-gather and reduce-scatter R-1 each, ZeRO's broadcast R-1 per parameter
    alpha = CostModel(link_bandwidth=1e30, link_latency=1e-3, dp_replicas=replicas)
    hop_ms = 1.0
    assert alpha.allreduce_ms([4_000]) == pytest.approx(2 * (replicas - 1) * hop_ms)
    assert replace(alpha, dp_bucket_bytes=4_000).allreduce_ms([4_000, 4_000]) == pytest.approx(
        2 * 2 * (replicas - 1) * hop_ms
    )  # two buckets, two all-reduces
    grad_op = replace(alpha, shard="grad-op")
    assert grad_op.dp_comm_ms([4_000], [(1000,)]) == pytest.approx(2 * (replicas - 1) * hop_ms)
    full = replace(alpha, shard="full")
    M = 3
    assert full.dp_comm_ms([4_000], [(1000,)], M) == pytest.approx(
        (2 * M + 1) * (replicas - 1) * hop_ms
    )
    zero = replace(alpha, shard="optimizer")
    assert zero.dp_comm_ms([4_000, 4_000], [(1000,), (1000,)]) == pytest.approx(
        (2 * (replicas - 1) + 2 * (replicas - 1)) * hop_ms
    )  # one bucket's all-reduce, two broadcasts
