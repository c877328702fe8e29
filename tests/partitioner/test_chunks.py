"""Planning S·V chunks: placement pricing, rank memory, the DP against brute force, step-time plans, auto."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from partition_fixtures import chain_profile

from fxpipe.errors import InfeasibleError, PartitionError
from fxpipe.partitioner import build_problem, evaluate, plan_partition, predict, solve_chain_dp
from fxpipe.partitioner.prediction import RuntimeCosts, rank_peak_memory, simulate_plan
from fxpipe.partitioner.problem import assignment_violations
from fxpipe.tracer.profile import ModelProfile, Unit

FREE = RuntimeCosts()


def test_problem_of_chunks() -> None:
    problem = build_problem(chain_profile([1.0] * 8, [1000] * 7), 2, schedule="zbv", microbatches=4)
    assert (problem.num_stages, problem.num_ranks, problem.virtual_stages) == (4, 2, 2)
    assert (
        problem.stage_ranks == (0, 1, 1, 0)
        and problem.same_rank(1, 2)
        and not problem.same_rank(0, 1)
    )
    assert [problem.in_flight(s) for s in range(4)] == [4, 3, 2, 1]
    assert problem.cut_factors(1) == (1.0, 0.0) and problem.cut_factors(2) == (0.0, 1.0)
    loop = build_problem(
        chain_profile([1.0] * 8), 2, schedule="interleaved-1f1b", microbatches=4, virtual_stages=3
    )
    assert loop.stage_ranks == (0, 1, 0, 1, 0, 1) and loop.placement == "loop"
    with pytest.raises(
        PartitionError, match="cannot split 3 units into 4 stages \\(2 ranks x 2 virtual stages\\)"
    ):
        build_problem(chain_profile([1.0] * 3), 2, schedule="zbv")
    with pytest.raises(PartitionError, match="runs 1 stages per rank, not --virtual-stages 2"):
        build_problem(chain_profile([1.0] * 8), 2, schedule="1f1b", virtual_stages=2)


def test_messages_between_stages_of_one_rank_are_free() -> None:
    problem = build_problem(
        chain_profile([1.0] * 4, [10**6] * 3), 2, schedule="zbv", microbatches=2
    )
    ev = evaluate(problem, (0, 1, 2, 3))
    assert ev.stages[1].send_bytes == 0 and ev.stages[2].recv_bytes == 0  # both on rank 1
    assert ev.stages[0].send_bytes == ev.stages[2].send_bytes == 10**6
    assert ev.stages[1].comm_fwd_ms == pytest.approx(
        problem.cost.message_ms(10**6)
    )  # only from stage 0


def test_rank_memory_counts_a_parameter_shared_by_two_stages_once() -> None:
    units = tuple(
        Unit(
            name=f"u{i}",
            module_path=f"m.{i}",
            fwd_ms=1.0,
            bwd_ms=1.0,
            params=(p,),
            activation_bytes=10,
        )
        for i, p in enumerate(["emb.weight", "a.weight", "b.weight", "head.weight"])
    )
    profile = ModelProfile(
        units=units,
        edges=(),
        batch_size=1,
        ties=(("emb.weight", "head.weight"),),
        param_sizes={"emb.weight": 1000, "a.weight": 100, "b.weight": 100},
    )
    problem = build_problem(profile, 2, schedule="zbv", microbatches=2)
    ev = evaluate(problem, (0, 1, 2, 3))
    tied_stages = ev.stages[0].memory_bytes + ev.stages[3].memory_bytes  # each counts its copy
    assert ev.rank_memory_bytes[0] == tied_stages - 1000 * problem.state_factor
    tight = replace(problem, memory_limit=ev.rank_memory_bytes[0] - 1)
    assert assignment_violations(tight, (0, 1, 2, 3)) == [
        f"rank 0 needs {ev.rank_memory_bytes[0]} bytes > limit {ev.rank_memory_bytes[0] - 1}"
    ]


@pytest.mark.parametrize("schedule", ["zbv", "interleaved-1f1b"])
def test_chain_dp_with_free_same_rank_cuts_matches_brute_force(schedule: str) -> None:
    profile = chain_profile(
        [3, 1, 4, 1, 5, 9, 2, 6], [5 * 10**5, 10**3, 10**6, 10**5, 10**3, 10**6, 10**3]
    )
    problem = build_problem(profile, 2, schedule=schedule, microbatches=4)
    values = []
    for cuts in itertools.combinations(range(1, 8), 3):
        bounds = (0, *cuts, 8)
        assignment = tuple(j for j in range(4) for _ in range(bounds[j + 1] - bounds[j]))
        values.append(evaluate(problem, assignment).bottleneck_ms)
    best = min(values)
    sol = solve_chain_dp(problem)
    assert sol.optimal and sol.bound_ms == pytest.approx(best, rel=1e-8)
    assert evaluate(problem, sol.assignment).bottleneck_ms == pytest.approx(best, rel=1e-8)


@pytest.mark.parametrize("schedule", ["zb-h1", "interleaved-1f1b", "zbv"])
def test_plans_for_step_time_never_worse_than_a_baseline(schedule: str) -> None:
    profile = chain_profile(
        [2, 1, 3, 1, 2, 2, 1, 3, 2, 1, 1, 2],
        [10**5] * 11,
        params=[1000] * 12,
        activations=[500] * 12,
    )
    plan = plan_partition(profile, 2, schedule=schedule, microbatches=4)
    assert plan.objective == "step" and plan.schedule == schedule
    assert plan.num_ranks == 2 and plan.num_stages == 2 * plan.virtual_stages
    assert plan.prediction is not None and schedule in plan.prediction.step_ms
    for name, base in plan.baselines.items():
        assert base.step_ms is not None and plan.step_ms <= base.step_ms * (1 + 1e-9), name
    assert "predicted step time of " + schedule in plan.optimal_for


def test_memory_limit_applies_per_rank() -> None:
    profile = chain_profile([1.0] * 12, [1000] * 11, params=[4000] * 12, activations=[1000] * 12)
    problem = build_problem(profile, 2, schedule="zbv", microbatches=4)
    splits = [(0, *cuts, 12) for cuts in itertools.combinations(range(1, 12), 3)]
    assignments = [tuple(j for j in range(4) for _ in range(b[j + 1] - b[j])) for b in splits]
    least = min(
        evaluate(problem, a).peak_memory_bytes for a in assignments
    )  # 70000 under the stage bound:
    # rank 1 holds its stages' activations 3 + 2 times
    # the plan keeps the whole step's walk (Note [fitting memory over time]) under the limit
    walked = min(
        max(rank_peak_memory(problem, a)) for a in assignments
    )  # 82000: the least any split holds
    # within 5% of the least, the repair loop's tighter stage bound finds a split that fits
    limit = int(walked * 1.05)
    plan = plan_partition(profile, 2, schedule="zbv", microbatches=4, memory_limit=limit)
    assert max(plan.prediction.peak_memory_bytes) <= limit and walked > least
    assert (
        max(plan.rank_memory_bytes) < least * 1.05
    )  # solved under a tighter stage bound than the limit
    assert len(plan.rank_memory_bytes) == 2 and plan.stage_ranks == (0, 1, 1, 0)
    assert "over the step" in plan.status
    # at the least any split walks to, the plan still fits: exactly
    plan = plan_partition(profile, 2, schedule="zbv", microbatches=4, memory_limit=walked)
    assert max(plan.prediction.peak_memory_bytes) == walked
    with pytest.raises(InfeasibleError, match="no split"):
        plan_partition(profile, 2, schedule="zbv", microbatches=4, memory_limit=least - 1)
    with pytest.raises(InfeasibleError, match="over the whole step"):
        plan_partition(profile, 2, schedule="zbv", microbatches=4, memory_limit=walked - 1)


def test_auto_keeps_the_fastest_schedule_and_lists_all() -> None:
    profile = chain_profile([2.0] * 16, [10**3] * 15, params=[1000] * 16)
    plan = plan_partition(profile, 2, schedule="auto", microbatches=4)
    options = {(o.schedule, o.virtual_stages): o for o in plan.alternatives}
    assert set(options) == {
        ("gpipe", 1),
        ("1f1b", 1),
        ("zb-h1", 1),
        ("interleaved-1f1b", 2),
        ("zbv", 2),
        ("dualpipev", 2),
    }
    fastest = min((o for o in options.values() if o.feasible), key=lambda o: o.step_ms or 0.0)
    assert fastest.chosen and (plan.schedule, plan.virtual_stages) == (
        fastest.schedule,
        fastest.virtual_stages,
    )
    assert plan.step_ms == pytest.approx(fastest.step_ms)
    assert all(o.timeline(4) is not None for o in options.values())
    # with V=2 asked for, only the schedules that run two stages per rank are tried
    two = plan_partition(profile, 2, schedule="auto", microbatches=4, virtual_stages=2)
    assert {o.schedule for o in two.alternatives} == {"interleaved-1f1b", "zbv", "dualpipev"}


def test_auto_reports_what_does_not_fit() -> None:
    profile = chain_profile([2.0] * 8, [10**3] * 7, params=[1000] * 8, activations=[10**5] * 8)
    one = plan_partition(profile, 2, schedule="1f1b", microbatches=8)
    gpipe_needs = max(
        plan_partition(profile, 2, schedule="gpipe", microbatches=8).rank_memory_bytes
    )
    limit = max(max(one.rank_memory_bytes), gpipe_needs - 1)
    plan = plan_partition(profile, 2, schedule="auto", microbatches=8, memory_limit=limit)
    gpipe = next(o for o in plan.alternatives if o.schedule == "gpipe")
    assert not gpipe.feasible and "does not fit" in gpipe.note and plan.schedule != "gpipe"


def test_split_backward_prediction_literal() -> None:
    """Two stages, F 1 ms, B 2 ms of which W 1 ms (a unit with parameters, no recorded fraction)."""
    units = tuple(
        Unit(name=f"u{i}", module_path=f"m.{i}", fwd_ms=1.0, bwd_ms=2.0, param_bytes=4)
        for i in range(2)
    )
    problem = build_problem(
        ModelProfile(units=units, edges=(), batch_size=1), 2, schedule="zb-h1", microbatches=2
    )
    assert (
        evaluate(problem, (0, 1)).stages[0].bwd_weight_ms == 1.0
    )  # the 0.5 fallback of older profiles
    # rank 0: F0 F1 . B0 W0 B1 W1 -- rank 1: . F0 B0 F1 B1 W0 W1  (B = input part, 1 ms)
    line = simulate_plan(problem, (0, 1), FREE)
    assert line.step_ms == pytest.approx(7.0)
    assert predict(problem, (0, 1), 1, runtime=FREE).pipeline_ms == {
        "zb-h1": pytest.approx(7.0),
        "gpipe": pytest.approx(9.0),
        "1f1b": pytest.approx(9.0),
    }


@pytest.mark.parametrize("seed, schedule", [(0, "zbv"), (1, "zbv"), (2, "interleaved-1f1b")])
def test_cpsat_prices_a_chunked_dag_exactly(seed: int, schedule: str) -> None:
    """Skip connections between stages of one rank are free in CP-SAT's model too: its proven
    optimum is the brute-force one under the exact cost, with a memory limit per rank."""
    import random

    from partition_fixtures import brute_force, random_dag

    from fxpipe.partitioner import solve_dag_cpsat

    profile = random_dag(random.Random(300 + seed), 7)
    free = build_problem(profile, 2, schedule=schedule, microbatches=2)
    limit = int(
        sorted(
            evaluate(free, a).peak_memory_bytes
            for a in [(0, 0, 1, 1, 2, 3, 3), (0, 1, 1, 2, 2, 3, 3)]
        )[-1]
    )
    problem = replace(free, memory_limit=limit)
    want = brute_force(problem)
    assert want is not None
    sol = solve_dag_cpsat(problem, time_limit=20)
    assert sol.optimal and not assignment_violations(problem, sol.assignment)
    assert evaluate(problem, sol.assignment).bottleneck_ms == pytest.approx(
        want[0], rel=1e-4, abs=1e-4
    )
