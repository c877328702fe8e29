"""RankLayout and the pure parts of the runtime (routes, microbatching)."""

from __future__ import annotations

import pytest
import torch

import handmade
from fxpipe.codegen.manifest import INPUT, BoundaryTensor, Manifest
from fxpipe.errors import BuildDirError, ConfigError, RuntimeSetupError
from fxpipe.runtime import Link, RankLayout
from fxpipe.runtime.pipeline.microbatch import check_divisible, split_inputs, split_targets
from fxpipe.runtime.pipeline.routes import routes_from_manifest


def test_layout_maps_ranks_replica_major() -> None:
    layout = RankLayout(num_stages=3, replicas=2)
    assert layout.world_size == 6
    assert [layout.stage_of(r) for r in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [layout.replica_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert layout.pipeline_ranks(1) == (3, 4, 5)
    assert layout.data_parallel_ranks(2) == (2, 5)
    assert all(layout.rank_of(layout.stage_of(r), layout.replica_of(r)) == r for r in range(6))
    single = RankLayout(4)
    assert [single.stage_of(r) for r in range(4)] == [0, 1, 2, 3] and single.data_parallel_ranks(
        1
    ) == (1,)


def test_layout_refuses_a_world_that_does_not_match() -> None:
    assert RankLayout.for_world(6, 3) == RankLayout(3, 2)
    with pytest.raises(
        RuntimeSetupError, match=r"world size 2 does not match .* 3 stages.*--nproc-per-node 3"
    ):
        RankLayout.for_world(2, 3)
    with pytest.raises(RuntimeSetupError, match="world size 4 does not match"):
        RankLayout.for_world(4, 3)
    with pytest.raises(RuntimeSetupError, match="rank 6 is outside"):
        RankLayout(3, 2).stage_of(6)


def test_routes_of_the_handmade_manifest() -> None:
    routes = routes_from_manifest(handmade.manifest())
    pairs = {(t.spec.name, t.src, t.dst, t.grad) for t in routes.transfers}
    assert pairs == {
        ("h0", 0, 1, True),
        ("h0", 0, 2, True),
        ("keep", 0, 1, False),
        ("h1", 1, 2, True),
    }
    assert routes.links() == (Link(0, 1, True), Link(0, 2, True), Link(1, 2, True))
    assert routes.model_outputs == ("logits",) and routes.input_names == ("idx", "scale")
    tags = {
        t.tag(m, routes.num_tensors, g)
        for t in routes.transfers
        for m in range(4)
        for g in (False, True)
    }
    assert (
        len(tags) == 4 * 4 * 2
    )  # unique per transfer (h0 goes to two stages), microbatch and direction


def test_model_output_from_an_earlier_stage_is_routed_to_the_last() -> None:
    m = handmade.manifest()
    s0 = m.stages[0]
    h0 = BoundaryTensor("h0", (2, 5, 8), "float32", 0, 0, (1, 2), True, 1)
    stages = (s0.__class__(**{**s0.__dict__, "outputs": (h0, s0.outputs[1])}),) + m.stages[1:]
    routes = routes_from_manifest(Manifest(**{**m.__dict__, "stages": stages}))
    assert routes.model_outputs == ("logits", "h0")
    assert sum(t.spec.name == "h0" and t.dst == 2 for t in routes.transfers) == 1


def test_routes_refuse_an_input_nobody_produces() -> None:
    m = handmade.manifest()
    s1 = m.stages[1]
    ghost = BoundaryTensor("ghost", (2, 8), "float32", 0, 0, (1,))
    stages = (
        m.stages[0],
        s1.__class__(**{**s1.__dict__, "inputs": s1.inputs + (ghost,)}),
        m.stages[2],
    )
    with pytest.raises(
        BuildDirError, match="stage 1 input 'ghost' comes from stage 0, which does not output it"
    ):
        routes_from_manifest(Manifest(**{**m.__dict__, "stages": stages}))
    bad_input = BoundaryTensor("nope", (2,), "int64", 0, INPUT, (0,))
    stages = (
        m.stages[0].__class__(**{**m.stages[0].__dict__, "inputs": (bad_input,)}),
    ) + m.stages[1:]
    with pytest.raises(BuildDirError, match="reads model input 'nope'"):
        routes_from_manifest(Manifest(**{**m.__dict__, "stages": stages}))


def test_microbatch_split_and_refusal() -> None:
    x, mask = torch.arange(12).reshape(6, 2), torch.ones(3, 3)
    mbs = split_inputs((x, mask), (0, None), 3)
    assert len(mbs) == 3 and torch.equal(mbs[1][0], x[2:4]) and mbs[2][1] is mask
    targets = split_targets({"y": torch.arange(6), "w": 0.5}, 2)
    assert torch.equal(targets[1]["y"], torch.tensor([3, 4, 5])) and targets[1]["w"] == 0.5
    assert check_divisible(8, 4) == 2
    with pytest.raises(ConfigError, match=r"batch size 6 does not split into 4 .* \[1, 2, 3, 6\]"):
        check_divisible(6, 4)
    with pytest.raises(ConfigError, match="got 1 model inputs but the build expects 2"):
        split_inputs((x,), (0, 0), 2)
