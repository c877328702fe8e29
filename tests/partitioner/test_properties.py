"""Hypothesis: every plan assigns every unit, keeps data flowing forward, fits memory, honours pins."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxpipe.errors import InfeasibleError
from fxpipe.partitioner import assignment_violations, build_problem, plan_partition
from fxpipe.partitioner.prediction import RUNTIME_COSTS
from fxpipe.tracer.profile import ModelProfile, Unit, UnitEdge


@st.composite
def profiles(draw: st.DrawFn) -> tuple[ModelProfile, int]:
    n = draw(st.integers(2, 9))
    S = draw(st.integers(1, min(4, n)))
    units = []
    for i in range(n):
        pin = (
            draw(st.one_of(st.none(), st.integers(0, S - 1)))
            if draw(st.integers(0, 5)) == 0
            else None
        )
        units.append(
            Unit(
                name=f"u{i}",
                module_path=f"m.{i}",
                fwd_ms=draw(st.floats(0.0, 5.0)),
                bwd_ms=draw(st.floats(0.0, 5.0)),
                param_bytes=draw(st.integers(0, 5000)),
                activation_bytes=draw(st.integers(0, 500)),
                pin=pin,
            )
        )
    pairs = {(i, i + 1) for i in range(n - 1)}
    for _ in range(draw(st.integers(0, n))):
        a = draw(st.integers(0, n - 2))
        pairs.add((a, draw(st.integers(a + 1, n - 1))))
    edges = tuple(UnitEdge(f"u{a}", f"u{b}", draw(st.integers(0, 10**6))) for a, b in sorted(pairs))
    # Pins must increase along the order so the problem is well posed for every solver.
    pins = [u.pin for u in units]
    running = 0
    fixed = []
    for u, p in zip(units, pins):
        if p is not None:
            running = max(running, p)
            fixed.append(Unit(**{**u.__dict__, "pin": running}))
        else:
            fixed.append(u)
    return ModelProfile(units=tuple(fixed), edges=edges, batch_size=1), S


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    profiles(),
    st.sampled_from(["auto", "dp", "greedy"]),
    st.sampled_from([None, 20_000]),
    st.sampled_from(["gpipe", "1f1b"]),
)
def test_plans_are_valid(
    case: tuple[ModelProfile, int], solver: str, limit: int | None, schedule: str
) -> None:
    profile, S = case
    try:
        plan = plan_partition(
            profile,
            S,
            solver=solver,
            memory_limit=limit,
            schedule=schedule,
            microbatches=2,
            time_limit=1.0,
        )
    except InfeasibleError:
        return
    assignment = tuple(plan.stage_of(u.name) for u in profile.units)
    problem = build_problem(profile, S, memory_limit=limit, schedule=schedule, microbatches=2)
    assert assignment_violations(problem, assignment) == []
    assert sorted(u for s in plan.stages for u in s.units) == sorted(u.name for u in profile.units)
    assert plan.lower_bound_ms <= plan.bottleneck_ms + 1e-9
    if solver == "auto":  # planned for step time, to its resolution (Note [planning for step time])
        resolution = RUNTIME_COSTS["cpu"].step_resolution
        for name, base in plan.baselines.items():
            if base.feasible:
                assert (
                    base.step_ms is not None
                    and plan.step_ms <= base.step_ms * (1 + resolution + 1e-9) + 1e-12
                ), name
                if (
                    limit is None and base.step_ms <= plan.step_ms
                ):  # within the resolution: not less bottleneck
                    assert plan.bottleneck_ms <= base.bottleneck_ms * (1 + 1e-9) + 1e-12, name
