"""Plans under a memory limit over the whole step (Note [fitting memory over time])."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxpipe.errors import InfeasibleError
from fxpipe.partitioner import build_problem, evaluate, plan_partition
from fxpipe.partitioner.memory_fit import contiguous_splits, fitting_split
from fxpipe.partitioner.planner import step_time_of
from fxpipe.partitioner.prediction import RUNTIME_COSTS, rank_peak_memory
from tests.partitioner.partition_fixtures import chain_profile


def test_contiguous_splits_are_every_monotone_split_that_honours_the_pins() -> None:
    free = build_problem(chain_profile([1.0] * 7), 3)
    splits = list(contiguous_splits(free))
    assert len(splits) == len(set(splits)) == math.comb(6, 2)
    assert all(list(a) == sorted(a) and set(a) == {0, 1, 2} for a in splits)
    pinned = build_problem(chain_profile([1.0] * 7, pins={2: 1}), 3)
    kept = list(contiguous_splits(pinned))
    assert kept == [a for a in splits if a[2] == 1]


@st.composite
def chains(draw: st.DrawFn) -> tuple[list[float], list[int], list[int], list[int], int]:
    n = draw(st.integers(3, 9))
    times = draw(st.lists(st.floats(0.1, 5.0), min_size=n, max_size=n))
    edges = draw(st.lists(st.sampled_from([0, 400, 4000, 40_000]), min_size=n - 1, max_size=n - 1))
    params = draw(st.lists(st.integers(0, 8) .map(lambda k: 1000 * k), min_size=n, max_size=n))
    acts = draw(st.lists(st.integers(0, 8).map(lambda k: 500 * k), min_size=n, max_size=n))
    return times, edges, params, acts, draw(st.integers(2, min(3, n)))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains(), st.sampled_from(["gpipe", "1f1b", "zb-h1"]))
def test_a_limit_any_split_walks_under_is_always_met(case: tuple, schedule: str) -> None:
    times, edges, params, acts, S = case
    profile = chain_profile(times, edges, params=params, activations=acts)
    problem = build_problem(profile, S, schedule=schedule, microbatches=4)
    least = min(max(rank_peak_memory(problem, a)) for a in contiguous_splits(problem))
    plan = plan_partition(profile, S, schedule=schedule, microbatches=4, memory_limit=least, time_limit=2.0)
    assert plan.prediction is not None and max(plan.prediction.peak_memory_bytes) <= least
    assert plan.memory_limit == least
    with pytest.raises(InfeasibleError, match="over the whole step"):
        plan_partition(profile, S, schedule=schedule, microbatches=4, memory_limit=least - 1, time_limit=2.0)


def test_walking_every_split_gives_up_only_on_its_time_budget() -> None:
    problem = build_problem(chain_profile([1.0] * 12, [4000] * 11, params=[1000] * 12), 3, microbatches=4)
    step_ms = step_time_of(problem, RUNTIME_COSTS["cpu"])
    roomy = 10**9
    assert fitting_split(problem, roomy, step_ms, budget_s=0.0) is None  # 55 splits, no time to walk them
    found = fitting_split(problem, roomy, step_ms)
    splits = list(contiguous_splits(problem))
    least_bottleneck = min(splits, key=lambda a: evaluate(problem, a).bottleneck_ms)
    assert found in splits and step_ms(found) <= step_ms(least_bottleneck)  # priced among the least bottlenecks
