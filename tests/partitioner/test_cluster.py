"""ClusterSpec, node-aware link pricing and activation recomputation in the cost model."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.errors import ConfigError, InfeasibleError, PartitionError
from fxpipe.partitioner.cluster import ClusterSpec
from fxpipe.partitioner.cost import LINK_PRESETS, CostModel, parse_size
from fxpipe.partitioner.solve.dp import solve_chain_dp
from fxpipe.partitioner.problem import build_problem, evaluate
from tests.partitioner.partition_fixtures import chain_profile


def test_cluster_spec_resolves_presets_and_round_trips() -> None:
    spec = ClusterSpec(devices=64, device_memory=parse_size("80GiB"))
    assert (spec.intra_bandwidth, spec.intra_latency) == LINK_PRESETS["nvlink"]
    assert (spec.inter_bandwidth, spec.inter_latency) == LINK_PRESETS["infiniband"]
    assert spec.nodes == 8
    assert ClusterSpec.from_dict(spec.to_dict()) == spec
    assert ClusterSpec.from_json(spec.to_json()) == spec
    assert "64 devices (8 nodes of 8), 80 GiB each" in spec.describe()


def test_cluster_spec_from_command_line_units() -> None:
    spec = ClusterSpec.from_options(
        12,
        device_memory="16GiB",
        node_size=4,
        intra_link="pcie",
        inter_link="mylink",
        inter_bandwidth_gbs=3.0,
        inter_latency_us=7.0,
    )
    assert spec.device_memory == 16 * 2**30
    assert spec.intra_bandwidth == LINK_PRESETS["pcie"][0]
    assert (spec.inter_link, spec.inter_bandwidth, spec.inter_latency) == ("custom", 3e9, 7e-6)
    assert spec.nodes == 3
    assert ClusterSpec.from_dict(json.loads(spec.to_json())) == spec


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"devices": 0}, "devices"),
        ({"devices": 8, "node_size": 0}, "node_size"),
        ({"devices": 8, "device_memory": -1}, "device_memory"),
        ({"devices": 8, "intra_link": "warp"}, "unknown intra-node link 'warp'"),
        ({"devices": 8, "inter_bandwidth": 0.0}, "inter-node bandwidth"),
        ({"devices": 8, "intra_latency": float("nan")}, "intra-node latency"),
    ],
)
def test_cluster_spec_rejects_bad_values(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        ClusterSpec(**kwargs)


def test_cluster_from_dict_names_the_field() -> None:
    with pytest.raises(ConfigError, match="devices"):
        ClusterSpec.from_dict({"devices": "many"})


@settings(max_examples=200, deadline=None)
@given(S=st.integers(1, 40), R=st.integers(1, 40), n=st.integers(1, 16), data=st.data())
def test_crosses_nodes_matches_the_device_layout(
    S: int, R: int, n: int, data: st.DataObject
) -> None:
    a = data.draw(st.integers(0, S - 1))
    b = data.draw(st.integers(0, S - 1))
    cost = CostModel(node_size=n, dp_replicas=R, inter_link_bandwidth=1e9)
    expected = any(
        (k * S + a) // n != (k * S + b) // n for k in range(R)
    )  # replica k's rank r is device k S + r
    assert cost.crosses_nodes(a, b, S) == expected


def test_messages_and_collectives_use_the_link_they_cross() -> None:
    cost = ClusterSpec(devices=32, node_size=8).cost_model(replicas=2)
    nbytes = 10**8
    assert cost.p2p_ms(nbytes, 6, 7, 16) == pytest.approx(cost.message_ms(nbytes))  # one node
    inter = (nbytes / LINK_PRESETS["infiniband"][0] + LINK_PRESETS["infiniband"][1]) * 1e3
    assert cost.p2p_ms(nbytes, 7, 8, 16) == pytest.approx(inter)  # devices 7 | 8
    assert cost.dp_link(16) == LINK_PRESETS["infiniband"]  # 32 devices: 4 nodes
    assert cost.dp_link(4) == LINK_PRESETS["nvlink"]  # 8 devices: one node
    assert cost.dp_comm_ms([10**8], num_ranks=16) > cost.dp_comm_ms([10**8], num_ranks=4)


def test_inter_node_boundary_costs_more_in_evaluate() -> None:
    profile = chain_profile([1.0] * 4, [10**8] * 3)
    one_node = build_problem(profile, 4, cost=ClusterSpec(devices=4, node_size=4).cost_model())
    two_nodes = build_problem(profile, 4, cost=ClusterSpec(devices=4, node_size=2).cost_model())
    a, b = evaluate(one_node, (0, 1, 2, 3)), evaluate(two_nodes, (0, 1, 2, 3))
    assert a.stages[0].comm_ms == pytest.approx(
        b.stages[0].comm_ms
    )  # 0 -> 1 inside node 0 either way
    assert b.stages[1].comm_ms > a.stages[1].comm_ms  # 1 -> 2 crosses nodes in the second


def _recompute_problem(recompute: tuple[bool, ...], memory_limit: int | None = None):
    profile = chain_profile([3.0, 3.0], activations=[1000, 1000], params=[100, 100])
    return build_problem(
        profile, 2, microbatches=4, cost=CostModel(recompute=recompute), memory_limit=memory_limit
    )


def test_recompute_adds_a_forward_and_keeps_one_microbatch_of_activations() -> None:
    plain = evaluate(_recompute_problem(()), (0, 1))
    redo = evaluate(_recompute_problem((True, False)), (0, 1))
    assert plain.stages[0].in_flight == 2  # 1F1B, first of 2 stages
    assert redo.stages[0].bwd_ms == pytest.approx(plain.stages[0].bwd_ms + plain.stages[0].fwd_ms)
    assert redo.stages[0].activation_bytes == 1000 and plain.stages[0].activation_bytes == 2000
    assert redo.stages[1] == plain.stages[1]


def test_recompute_lets_the_dp_fit_a_memory_limit() -> None:
    plain = _recompute_problem((), memory_limit=2100)
    with pytest.raises(InfeasibleError):
        solve_chain_dp(plain)
    fits = solve_chain_dp(_recompute_problem((True, False), memory_limit=2100))
    assert (
        max(evaluate(_recompute_problem((True, False)), fits.assignment).rank_memory_bytes) <= 2100
    )


def test_recompute_needs_one_flag_per_stage_and_an_unsplit_backward() -> None:
    with pytest.raises(PartitionError, match="recompute lists 1 stages but there are 2"):
        _recompute_problem((True,))
    profile = chain_profile([1.0, 1.0])
    with pytest.raises(PartitionError, match="splits the backward"):
        build_problem(profile, 2, schedule="zb-h1", cost=CostModel(recompute=(True, False)))
    with pytest.raises(ConfigError, match="recompute"):
        CostModel(recompute=(1, 0))  # type: ignore[arg-type]


def test_cost_model_round_trips_the_cluster_fields() -> None:
    cost = ClusterSpec(devices=16).cost_model(replicas=2, recompute=(True, False))
    assert CostModel.from_dict(json.loads(json.dumps(cost.to_dict()))) == cost
