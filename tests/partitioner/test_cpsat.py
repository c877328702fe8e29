"""CP-SAT: equal to the DP on chains, to brute force on small DAGs, never worse than the DP."""

from __future__ import annotations

import random

import pytest
from partition_fixtures import brute_force, chain_profile, random_chain, random_dag

from fxpipe.errors import InfeasibleError
from fxpipe.partitioner import (
    build_problem,
    evaluate,
    plan_partition,
    predict,
    solve_chain_dp,
    solve_dag_cpsat,
)
from fxpipe.partitioner.prediction import RUNTIME_COSTS
from fxpipe.tracer.profile import ModelProfile, Unit, UnitEdge

TOL = 1e-3  # ms: CP-SAT floors times to 10 ns per term


@pytest.mark.parametrize("seed", range(6))
def test_cpsat_equals_dp_on_chains(seed: int) -> None:
    rng = random.Random(seed)
    problem = build_problem(random_chain(rng, 12), 3, microbatches=2)
    dp = solve_chain_dp(problem)
    cp = solve_dag_cpsat(problem, time_limit=5, workers=1)
    assert cp.optimal
    assert evaluate(problem, cp.assignment).bottleneck_ms == pytest.approx(
        evaluate(problem, dp.assignment).bottleneck_ms, abs=TOL
    )


@pytest.mark.parametrize("seed", range(6))
def test_cpsat_equals_brute_force_on_small_dags(seed: int) -> None:
    rng = random.Random(100 + seed)
    problem = build_problem(
        random_dag(rng, 7), 3, microbatches=2, memory_limit=rng.choice([None, 40_000])
    )
    best = brute_force(problem)
    if best is None:
        with pytest.raises(InfeasibleError):
            solve_dag_cpsat(problem, time_limit=5, workers=1)
        return
    cp = solve_dag_cpsat(problem, time_limit=5, workers=1)
    assert cp.optimal
    assert evaluate(problem, cp.assignment).bottleneck_ms == pytest.approx(best[0], abs=TOL)
    assert cp.bound_ms is not None and cp.bound_ms <= best[0] + 1e-9


@pytest.mark.parametrize("seed", range(4))
def test_auto_never_worse_than_dp_or_baselines_on_dags(seed: int) -> None:
    rng = random.Random(200 + seed)
    profile = random_dag(rng, 30)
    plan = plan_partition(profile, 4, microbatches=4, time_limit=3)
    problem = build_problem(profile, 4, microbatches=4)
    dp = predict(problem, solve_chain_dp(problem).assignment, profile.batch_size).step_ms["1f1b"]
    # the objective is the predicted step time, to its resolution (Note [planning for step time])
    resolution = RUNTIME_COSTS["cpu"].step_resolution
    assert plan.step_ms <= dp * (1 + resolution + 1e-9)
    for name, base in plan.baselines.items():
        assert base.step_ms is not None and plan.step_ms <= base.step_ms * (
            1 + resolution + 1e-9
        ), name
        if (
            base.feasible and base.step_ms <= plan.step_ms
        ):  # predicted faster, so within the resolution
            assert plan.bottleneck_ms <= base.bottleneck_ms * (1 + 1e-9), name


def test_skip_connection_is_sent_once_to_each_later_stage() -> None:
    # u0 feeds u1 and (skip) u3; on stages (0, 1, 1, 2) u0's output travels to 1 and to 2.
    units = tuple(Unit(name=f"u{i}", module_path=f"m.{i}", fwd_ms=1.0) for i in range(4))
    edges = (
        UnitEdge("u0", "u1", 1000),
        UnitEdge("u1", "u2", 10),
        UnitEdge("u2", "u3", 10),
        UnitEdge("u0", "u3", 1000),
    )
    problem = build_problem(ModelProfile(units=units, edges=edges, batch_size=1), 3)
    ev = evaluate(problem, (0, 1, 1, 2))
    assert ev.stages[0].send_bytes == 2000 and ev.stages[0].messages == 4
    assert ev.stages[1].recv_bytes == 1000 and ev.stages[2].recv_bytes == 1010


def test_cpsat_honours_pins_off_the_contiguous_order() -> None:
    # Two independent branches: pins that no contiguous split of the order can meet.
    units = (
        Unit(name="a0", module_path="a.0", fwd_ms=1, pin=1),
        Unit(name="b0", module_path="b.0", fwd_ms=1, pin=0),
        Unit(name="a1", module_path="a.1", fwd_ms=1),
        Unit(name="b1", module_path="b.1", fwd_ms=1),
    )
    edges = (UnitEdge("a0", "a1", 100), UnitEdge("b0", "b1", 100))
    plan = plan_partition(ModelProfile(units=units, edges=edges, batch_size=1), 2, time_limit=3)
    assert plan.stage_of("a0") == 1 and plan.stage_of("b0") == 0
    assert plan.solver == "cpsat"


def test_memory_objective_trades_a_little_speed() -> None:
    profile = chain_profile([1.0] * 8, [0] * 7, params=[0, 0, 0, 0, 0, 0, 0, 80_000])
    fast = plan_partition(profile, 2, solver="dp")
    lean = plan_partition(profile, 2, solver="dp", optimize="memory")
    assert lean.bottleneck_ms <= fast.bottleneck_ms * 1.01 + 1e-9
    assert max(s.memory_bytes for s in lean.stages) <= max(s.memory_bytes for s in fast.stages)
    lean_cp = plan_partition(profile, 2, solver="cpsat", optimize="memory", time_limit=3)
    assert max(s.memory_bytes for s in lean_cp.stages) <= max(s.memory_bytes for s in fast.stages)
