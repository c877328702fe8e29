"""Plans under a memory limit over the whole step (Note [fitting memory over time])."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxpipe.errors import InfeasibleError
from fxpipe.partitioner import CostModel, build_problem, evaluate, plan_partition
from fxpipe.partitioner.solve import memory_fit
from fxpipe.partitioner.solve.baselines import run_baseline
from fxpipe.partitioner.solve.memory_fit import (
    contiguous_splits,
    count_contiguous_splits,
    fitting_split,
)
from fxpipe.partitioner.solve.planner import _plan_split, step_time_of
from fxpipe.partitioner.prediction import RUNTIME_COSTS, rank_peak_memory
from tests.partitioner.partition_fixtures import chain_profile, random_dag


def test_contiguous_splits_are_every_monotone_split_that_honours_the_pins() -> None:
    free = build_problem(chain_profile([1.0] * 7), 3)
    splits = list(contiguous_splits(free))
    assert len(splits) == len(set(splits)) == math.comb(6, 2) == count_contiguous_splits(free)
    assert all(list(a) == sorted(a) and set(a) == {0, 1, 2} for a in splits)
    pinned = build_problem(chain_profile([1.0] * 7, pins={2: 1}), 3)
    kept = list(contiguous_splits(pinned))
    assert kept == [a for a in splits if a[2] == 1] and count_contiguous_splits(pinned) == len(kept)


@pytest.mark.parametrize("seed", range(6))
def test_split_count_and_order_match_filtering_every_split(seed: int) -> None:
    rng = random.Random(seed)
    n, S = rng.randint(4, 9), rng.randint(2, 4)
    pins = {
        u: s for u, s in ((rng.randrange(n), rng.randrange(S)) for _ in range(rng.randint(0, 2)))
    }
    problem = build_problem(chain_profile([1.0] * n, pins=dict(sorted(pins.items()))), min(S, n))
    S = problem.num_stages
    every = [
        tuple(j for j, (a, b) in enumerate(zip((0, *cuts), (*cuts, n))) for _ in range(a, b))
        for cuts in itertools.combinations(range(1, n), S - 1)
    ]
    honouring = [a for a in every if all(problem.pins[u] in (None, s) for u, s in enumerate(a))]
    try:
        splits = list(contiguous_splits(problem))
    except InfeasibleError:  # pins that contradict the order: nothing to enumerate
        return
    assert splits == honouring and count_contiguous_splits(problem) == len(honouring)


def test_pins_bound_the_count_on_a_long_chain() -> None:
    problem = build_problem(chain_profile([1.0] * 2000, pins={999: 0, 1000: 1}), 3)
    assert (
        count_contiguous_splits(problem) == 999
    )  # the first cut is fixed, the second free after it
    assert sum(1 for _ in contiguous_splits(problem)) == 999


@st.composite
def chains(draw: st.DrawFn) -> tuple[list[float], list[int], list[int], list[int], int]:
    n = draw(st.integers(3, 9))
    times = draw(st.lists(st.floats(0.1, 5.0), min_size=n, max_size=n))
    edges = draw(st.lists(st.sampled_from([0, 400, 4000, 40_000]), min_size=n - 1, max_size=n - 1))
    params = draw(st.lists(st.integers(0, 8).map(lambda k: 1000 * k), min_size=n, max_size=n))
    acts = draw(st.lists(st.integers(0, 8).map(lambda k: 500 * k), min_size=n, max_size=n))
    return times, edges, params, acts, draw(st.integers(2, min(3, n)))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains(), st.sampled_from(["gpipe", "1f1b", "zb-h1"]))
def test_a_limit_any_split_walks_under_is_always_met(case: tuple, schedule: str) -> None:
    times, edges, params, acts, S = case
    profile = chain_profile(times, edges, params=params, activations=acts)
    problem = build_problem(profile, S, schedule=schedule, microbatches=4)
    least = min(max(rank_peak_memory(problem, a)) for a in contiguous_splits(problem))
    plan = plan_partition(
        profile, S, schedule=schedule, microbatches=4, memory_limit=least, time_limit=2.0
    )
    assert plan.prediction is not None and max(plan.prediction.peak_memory_bytes) <= least
    assert plan.memory_limit == least
    if plan.solver == "all-splits":  # the baselines' feasibility is the walk's too
        for name, report in plan.baselines.items():
            walked = max(rank_peak_memory(problem, run_baseline(name, problem).assignment))
            assert report.feasible == (walked <= least), name
    with pytest.raises(
        InfeasibleError, match="over the whole step"
    ):  # on a chain every split is contiguous
        plan_partition(
            profile, S, schedule=schedule, microbatches=4, memory_limit=least - 1, time_limit=2.0
        )


def test_walking_every_split_gives_up_only_on_its_time_budget() -> None:
    problem = build_problem(
        chain_profile([1.0] * 12, [4000] * 11, params=[1000] * 12), 3, microbatches=4
    )
    step_ms = step_time_of(problem, RUNTIME_COSTS["cpu"])
    roomy = 10**9
    assert (
        fitting_split(problem, roomy, step_ms, budget_s=0.0) is None
    )  # 55 splits, no time to walk them
    found = fitting_split(problem, roomy, step_ms)
    splits = list(contiguous_splits(problem))
    least_bottleneck = min(splits, key=lambda a: evaluate(problem, a).bottleneck_ms)
    assert found in splits and step_ms(found) <= step_ms(
        least_bottleneck
    )  # priced among the least bottlenecks


def test_walking_every_split_keeps_the_planners_objective() -> None:
    profile = chain_profile(
        [1.0, 2.0, 1.0, 3.0, 1.0, 2.0, 1.0, 1.0],
        [4000] * 7,
        params=[1000, 9000] * 4,
        activations=[500, 3000] * 4,
    )
    problem = build_problem(profile, 2, microbatches=4)
    step_ms = step_time_of(problem, RUNTIME_COSTS["cpu"])
    splits = list(contiguous_splits(problem))
    bottleneck = {a: evaluate(problem, a).bottleneck_ms for a in splits}
    best = min(bottleneck.values())
    by_memory = fitting_split(problem, 10**9, step_ms, optimize="memory", slack=0.5)
    near = [a for a in splits if bottleneck[a] <= best * 1.5]
    assert by_memory is not None
    assert max(rank_peak_memory(problem, by_memory)) == min(
        max(rank_peak_memory(problem, a)) for a in near
    )
    by_bottleneck = fitting_split(problem, 10**9, step_ms, objective="bottleneck")
    assert by_bottleneck is not None and bottleneck[by_bottleneck] == best


def test_on_a_branching_graph_the_error_says_what_was_not_walked() -> None:
    profile = random_dag(random.Random(3), 7)
    assert not build_problem(profile, 2).is_chain
    with pytest.raises(InfeasibleError, match="branching graph, were not walked"):
        plan_partition(profile, 2, memory_limit=1_000, time_limit=2.0)


def test_a_split_the_formula_rejects_but_whose_walk_fits_is_planned_without_walking_every_split(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # found by search: NCCL posts receives by action, and under GPipe this chain's every split holds more by the
    # stage formula (gradients and all 8 microbatches' activations at once) than its walk does at any moment
    profile = replace(
        chain_profile(
            [2.99, 1.35, 1.09, 0.70, 1.13, 2.15],
            [0, 400, 400, 0, 400],
            params=[9000, 10000, 0, 1000, 17000, 19000],
            activations=[2500, 1500, 3500, 3500, 2000, 2000],
        ),
        trace_device="cuda",
    )
    # bytes this small: the cuBLAS workspaces (which the formula leaves out) would make every walk the larger
    monkeypatch.setitem(RUNTIME_COSTS, "cuda", replace(RUNTIME_COSTS["cuda"], workspace_bytes=0))
    problem = build_problem(profile, 2, schedule="gpipe", microbatches=8)
    splits = list(contiguous_splits(problem))
    walked = {a: max(rank_peak_memory(problem, a, runtime=RUNTIME_COSTS["cuda"])) for a in splits}
    least = min(walked.values())
    assert (
        min(evaluate(problem, a).peak_memory_bytes for a in splits) > least
    )  # the formula rejects them all
    monkeypatch.setattr(
        memory_fit, "EXACT_MAX_SPLITS", 0
    )  # as on a model too large to walk every split
    plan = plan_partition(
        profile, 2, schedule="gpipe", microbatches=8, memory_limit=least, time_limit=2.0
    )
    assert max(plan.prediction.peak_memory_bytes) <= least and plan.memory_limit == least
    assert "rank peak" in plan.status
    for (
        name,
        report,
    ) in plan.baselines.items():  # held to the walk under the user's limit, not the looser bound
        walked = max(
            rank_peak_memory(
                problem, run_baseline(name, problem).assignment, runtime=RUNTIME_COSTS["cuda"]
            )
        )
        assert report.feasible == (walked <= least), name


def test_a_looser_bound_is_bisected_until_its_plans_walk_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a fake solver: no split under a bound below 120; under bound b its plan's formula peak is b and its walk
    # b - 30; unbounded: formula 200, walk 150. With the limit at 100, 120-130 fit: bisection finds 125
    def plan(formula: int, walk: int) -> SimpleNamespace:
        return SimpleNamespace(
            rank_memory_bytes=(formula,), prediction=SimpleNamespace(peak_memory_bytes=(walk,))
        )

    def solve(bound: int | None) -> SimpleNamespace:
        if bound is None:
            return plan(200, 150)
        if bound < 120:
            raise InfeasibleError("no split under the bound")
        return plan(bound, bound - 30)

    monkeypatch.setattr(memory_fit, "_fitted", lambda p, limit: p)
    found = memory_fit._under_looser_bound(solve, 100)
    assert (
        found is not None
        and found.rank_memory_bytes == (125,)
        and found.prediction.peak_memory_bytes == (95,)
    )
    assert (
        memory_fit._under_looser_bound(
            lambda b: plan(200, 101) if b is None or b >= 200 else plan(b, 101), 100
        )
        is None
    )  # no bound's walk fits


def test_the_first_bound_leaves_room_for_what_only_the_walk_counts() -> None:
    # the CUDA libraries' workspace is in every walk, not in the stage formula: the first solve is under the rest
    @dataclass(frozen=True)
    class Plan:
        prediction: SimpleNamespace
        status: str = ""
        memory_limit: int | None = None

    bounds = []

    def solve(bound: int | None) -> Plan:
        bounds.append(bound)
        return Plan(SimpleNamespace(peak_memory_bytes=((bound or 0) + 100,)))

    def never(limit: int) -> None:
        raise AssertionError("no walk of every split is needed")

    fitted = memory_fit.fit_memory_over_time(solve, 1000, never, reserved=100)
    assert bounds == [900] and fitted.memory_limit == 1000
    bounds.clear()
    memory_fit.fit_memory_over_time(
        solve, 1000, never
    )  # nothing reserved: tighter bounds, one solve each
    assert bounds == [1000, 909, 900]


def test_a_loosened_plan_holds_its_baselines_to_the_walk_under_the_users_limit() -> None:
    profile = chain_profile(
        [1.0, 2.0, 1.0, 3.0, 1.0, 2.0],
        [4000] * 5,
        params=[1000, 9000] * 3,
        activations=[500, 3000] * 3,
    )
    kwargs = dict(
        solver="dp",
        schedule="1f1b",
        microbatches=4,
        cost=CostModel(),
        memory_limit=None,
        time_limit=2.0,
        optimize="speed",
        virtual_stages=None,
        objective="step",
        split_at=(),
    )
    free = _plan_split(profile, 2, **kwargs)
    assert all(report.feasible for report in free.baselines.values())
    problem = build_problem(profile, 2, schedule="1f1b", microbatches=4)
    walks = {
        name: max(rank_peak_memory(problem, run_baseline(name, problem).assignment))
        for name in free.baselines
    }
    held = _plan_split(profile, 2, **kwargs, baselines_walk=min(walks.values()) - 1)
    assert not any(report.feasible for report in held.baselines.values())
    assert all(report.violations for report in held.baselines.values())


def test_when_no_looser_bound_fits_the_error_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    profile = chain_profile(
        [1.0, 2.0, 1.0, 3.0], [4000] * 3, params=[1000, 9000] * 2, activations=[500, 3000] * 2
    )
    monkeypatch.setattr(memory_fit, "EXACT_MAX_SPLITS", 0)
    with pytest.raises(
        InfeasibleError, match="nor does any plan solved under a looser stage bound fit"
    ):
        plan_partition(profile, 2, microbatches=4, memory_limit=1_000, time_limit=2.0)
