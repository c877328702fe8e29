"""``--split-at``: stages that start at named modules, honoured by every solver; clear errors."""

from __future__ import annotations

import pytest
from partition_fixtures import chain_profile, random_dag

from fxpipe.errors import PinError
from fxpipe.partitioner import plan_partition
from fxpipe.partitioner.problem import build_problem
from fxpipe.partitioner.solve.split_points import pin_split_points

import random

# layers.0 .. layers.7; the balanced split would be {0..3} {4..7}
TIMES = [1.0] * 8


def _stages(plan) -> list[list[str]]:
    return [list(s.units) for s in plan.stages]


@pytest.mark.parametrize("solver", ["auto", "dp", "cpsat"])
def test_split_points_fix_where_stages_begin(solver: str) -> None:
    plan = plan_partition(
        chain_profile(TIMES), 3, solver=solver, split_at=("layers.2", "layers.7"), time_limit=5
    )
    assert _stages(plan) == [["u0", "u1"], ["u2", "u3", "u4", "u5", "u6"], ["u7"]]
    assert "--split-at layers.2, layers.7" in plan.status
    # without them the solver balances differently: the split points are what moved the stages
    free = plan_partition(chain_profile(TIMES), 3, solver=solver, time_limit=5)
    assert _stages(free) != _stages(plan)


def test_split_points_are_sorted_by_graph_order_and_match_submodules() -> None:
    profile = chain_profile(TIMES, prefix="blocks")
    profile = profile.__class__(
        units=tuple(
            u.__class__(**{**u.__dict__, "module_path": f"{u.module_path}.attn"})
            for u in profile.units
        ),
        edges=profile.edges,
        batch_size=1,
    )
    plan = plan_partition(
        profile, 3, split_at=("blocks.6", "blocks.3")
    )  # a parent path matches its units
    assert _stages(plan) == [["u0", "u1", "u2"], ["u3", "u4", "u5"], ["u6", "u7"]]


def test_split_points_on_a_dag_keep_data_flowing_forward() -> None:
    profile = random_dag(random.Random(3), 12)
    plan = plan_partition(profile, 2, split_at=("net.5",), solver="cpsat", time_limit=5)
    assert plan.stage_of("u4") == 0 and plan.stage_of("u5") == 1


def test_unknown_module_names_close_matches() -> None:
    with pytest.raises(
        PinError, match=r"--split-at 'layer.3' matches no unit.*did you mean 'layers.3'"
    ):
        plan_partition(chain_profile(TIMES), 2, split_at=("layer.3",))


def test_a_module_inside_a_unit_says_why_and_where_a_stage_can_start() -> None:
    """layers.2 and layers.3 share one unit (its path the common one, as where an in-place write joins two
    modules): the profile's module order still knows layers.3, so the message says why and names the next
    module that starts a unit."""
    paths = ["layers.0", "layers.1", "layers", "layers.4", "layers.5", "layers.6", "layers.7"]
    profile = chain_profile([1.0] * 7)
    joined = profile.__class__(
        units=tuple(
            u.__class__(**{**u.__dict__, "module_path": p}) for u, p in zip(profile.units, paths)
        ),
        edges=profile.edges,
        batch_size=1,
        module_order=tuple(f"layers.{i}" for i in range(8)),
    )
    with pytest.raises(
        PinError,
        match=r"--split-at 'layers.3' names a module that shares a unit with what runs "
        r"before it .* split at the next module that starts a unit, 'layers.4'",
    ):
        plan_partition(joined, 2, split_at=("layers.3",))
    assert _stages(plan_partition(joined, 2, split_at=("layers.4",)))[1][0] == "u3"


@pytest.mark.parametrize(
    "split_at, stages, fragment",
    [
        (
            ("layers.2",),
            3,
            r"1 --split-at point make 2 stages, but the plan has 3; give 2 split points or use --stages 2",
        ),
        (("layers.2", "layers.4", "layers.6"), 3, "3 --split-at points make 4 stages"),
        (("layers.0",), 2, "first unit"),
        (("layers.3", "layers.3"), 3, "both start at unit 'u3'"),
    ],
)
def test_split_points_that_contradict_the_stages(
    split_at: tuple[str, ...], stages: int, fragment: str
) -> None:
    with pytest.raises(PinError, match=fragment):
        plan_partition(chain_profile(TIMES), stages, split_at=split_at)


def test_split_points_against_a_manual_pin() -> None:
    profile = chain_profile(TIMES, pins={5: 0})
    with pytest.raises(
        PinError, match=r"unit 'u5' is pinned to stage 0 \(fxpipe.partition\).*stage 1"
    ):
        pin_split_points(build_problem(profile, 2), ("layers.4",))
    assert pin_split_points(build_problem(profile, 2), ("layers.6",)).pins == (0,) * 6 + (1, 1)


def test_schedule_auto_keeps_the_candidates_the_split_points_fit() -> None:
    plan = plan_partition(
        chain_profile(TIMES), 2, schedule="auto", microbatches=4, split_at=("layers.3",)
    )
    assert plan.virtual_stages == 1 and _stages(plan) == [
        ["u0", "u1", "u2"],
        ["u3", "u4", "u5", "u6", "u7"],
    ]
    refused = [o for o in plan.alternatives if not o.feasible]
    assert refused and all("--split-at" in o.note for o in refused)
