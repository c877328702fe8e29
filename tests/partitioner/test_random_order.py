"""Units that draw random numbers keep their program order across stages (Note [random order] in problem.py)."""

from __future__ import annotations

import dataclasses

import pytest

from fxpipe.errors import InfeasibleError
from fxpipe.partitioner import build_problem, evaluate, plan_partition, solve_dag_cpsat
from fxpipe.partitioner.problem import assignment_violations
from fxpipe.tracer.profile import ModelProfile, TensorSpec, Unit, UnitEdge


def _two_branches(random: bool, pins: dict[str, int] | None = None) -> ModelProfile:
    """src -> (a, b) -> join; a comes first in the program, but the best split runs b on stage 0."""
    times = {"src": 1.0, "a": 4.5, "b": 4.0, "join": 0.5}
    units = tuple(
        Unit(
            name=n,
            module_path=n,
            fwd_ms=t / 3,
            bwd_ms=2 * t / 3,
            outputs=(TensorSpec((1, 4)),),
            random=random and n in ("a", "b"),
            pin=(pins or {}).get(n),
        )
        for n, t in times.items()
    )
    edges = tuple(
        UnitEdge(s, d, 16) for s, d in [("src", "a"), ("src", "b"), ("a", "join"), ("b", "join")]
    )
    return ModelProfile(units=units, edges=edges, batch_size=1)


def test_without_random_units_the_best_split_reorders_the_branches() -> None:
    problem = build_problem(_two_branches(random=False), 2)
    assert problem.random_units == ()
    cp = solve_dag_cpsat(problem, time_limit=5, workers=1)
    assert cp.optimal and cp.assignment == (0, 1, 0, 1)  # b before a: fine without random numbers


def test_cpsat_keeps_random_units_in_program_order() -> None:
    problem = build_problem(_two_branches(random=True), 2)
    assert problem.random_units == (1, 2)
    cp = solve_dag_cpsat(problem, time_limit=5, workers=1)
    assert cp.optimal and cp.assignment[1] <= cp.assignment[2]
    assert not assignment_violations(problem, cp.assignment)
    best_free = evaluate(build_problem(_two_branches(random=False), 2), (0, 1, 0, 1)).bottleneck_ms
    assert (
        evaluate(problem, cp.assignment).bottleneck_ms > best_free
    )  # the order costs something here


def test_violations_name_the_random_units_out_of_order() -> None:
    problem = build_problem(_two_branches(random=True), 2)
    (message,) = assignment_violations(problem, (0, 1, 0, 1))
    assert "'b' draws random numbers on stage 0, before 'a' on stage 1" in message


def test_pins_that_reverse_random_units_are_infeasible() -> None:
    problem = build_problem(_two_branches(random=True, pins={"a": 1, "b": 0}), 2)
    with pytest.raises(InfeasibleError):
        solve_dag_cpsat(problem, time_limit=5, workers=1)


def test_plan_partition_honours_the_order_and_profiles_keep_the_flag(tmp_path) -> None:
    profile = _two_branches(random=True)
    plan = plan_partition(profile, 2, solver="auto", time_limit=5)
    stage_of = {u: s for s, st in enumerate(plan.stages) for u in st.units}
    assert stage_of["a"] <= stage_of["b"]
    path = tmp_path / "profile.json"
    profile.to_json(path)
    again = ModelProfile.from_json(path)
    assert [u.random for u in again.units] == [False, True, True, False]
    assert (
        ModelProfile.from_dict(
            {
                **profile.to_dict(),
                "units": [
                    {k: v for k, v in dataclasses.asdict(u).items() if k != "random"}
                    for u in profile.units
                ],
            }
        )
        .units[1]
        .random
        is False
    )  # profiles written before the flag read as "no random numbers"
