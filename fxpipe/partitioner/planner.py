"""``plan_partition``: profile in, ``PartitionPlan`` out (solver choice, bound, baselines, prediction).

Orchestration only: build the problem, run the solvers, keep the best split, and price
it (``fxpipe.partitioner.prediction`` predicts the step, Note [step prediction]).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

from fxpipe.errors import InfeasibleError, PartitionError
from fxpipe.partitioner.baselines import BASELINES, run_baseline
from fxpipe.partitioner.bounds import lower_bound
from fxpipe.partitioner.cost import CostModel, format_size
from fxpipe.partitioner.cpsat import solve_dag_cpsat
from fxpipe.partitioner.dp import solve_chain_dp
from fxpipe.partitioner.pins import stage_ranges
from fxpipe.partitioner.plan import BaselineReport, PartitionPlan, StageMemory, StagePlan
from fxpipe.partitioner.prediction import RUNTIME_COSTS, RuntimeCosts, predict
from fxpipe.partitioner.problem import (
    Evaluation,
    PartitionProblem,
    assignment_violations,
    build_problem,
    evaluate,
)
from fxpipe.partitioner.solution import Solution
from fxpipe.tracer.profile import ModelProfile

__all__ = ["plan_partition", "plan_from_assignment", "SOLVERS", "CPSAT_MAX_VARIABLES"]

SOLVERS = ("auto", "dp", "cpsat", *BASELINES)
CPSAT_MAX_VARIABLES = 200_000  # auto skips CP-SAT above units x stages x (1 + tensors/unit)
_MEMORY_SLACK = 0.01           # optimize="memory" may give up 1% of speed
_TIE_REL = 1e-9                # bottlenecks this close (relative) are equal; the predicted step decides
_BOUND_TOL = 1e-6              # a lower bound may exceed the plan's bottleneck by float noise only


def plan_partition(profile: ModelProfile, num_stages: int, *, solver: str = "auto", schedule: str = "1f1b",
                   microbatches: int = 1, cost: CostModel | None = None, memory_limit: int | None = None,
                   time_limit: float = 10.0, optimize: str = "speed") -> PartitionPlan:
    """Split ``profile``'s units into ``num_stages`` pipeline stages.

    ``solver``: ``auto`` (exact DP on contiguous splits, then CP-SAT over the DAG when the
    graph branches or the memory limit binds, within ``time_limit`` seconds; the better
    plan wins), ``dp``, ``cpsat``, or a baseline (``uniform``, ``params``, ``greedy``).
    ``optimize="memory"`` minimises peak stage memory among plans within 1% of the best
    bottleneck. The baselines are always evaluated and reported beside the plan.

    >>> plan = plan_partition(profile, 4, microbatches=8, memory_limit=parse_size("16GiB"))  # doctest: +SKIP
    >>> plan.stage_of("blocks.3"), plan.bottleneck_ms, plan.gap                             # doctest: +SKIP
    """
    if solver not in SOLVERS:
        raise PartitionError(f"unknown solver {solver!r}; expected one of {list(SOLVERS)}")
    if optimize not in ("speed", "memory"):
        raise PartitionError(f"optimize must be 'speed' or 'memory', got {optimize!r}")
    if not (isinstance(time_limit, (int, float)) and math.isfinite(time_limit) and time_limit > 0):
        raise PartitionError(f"time_limit must be a finite number of seconds > 0, got {time_limit!r}")
    start = time.perf_counter()
    problem = build_problem(profile, num_stages, schedule=schedule, microbatches=microbatches,
                            cost=cost, memory_limit=memory_limit)
    stage_ranges(problem)  # contradictory pins fail here, before any solver runs
    baselines = {name: run_baseline(name, problem) for name in BASELINES}
    bound, parts = lower_bound(problem)
    chosen = _solve(problem, solver, baselines, bound, time_limit, optimize)
    if solver not in BASELINES:
        runtime = RUNTIME_COSTS.get(profile.trace_device, RUNTIME_COSTS["cpu"])

        def step_ms(assignment: tuple[int, ...]) -> float:
            return float(predict(problem, assignment, profile.batch_size, runtime=runtime).step_ms[schedule])

        chosen = _pick_best(problem, chosen, baselines, step_ms, optimize)
    proven = {f"{chosen.solver}_proven": chosen.bound_ms} if chosen.bound_ms is not None else {}
    bound, parts = lower_bound(problem, proven=proven)
    return plan_from_assignment(profile, problem, chosen, baselines, bound, parts,
                                seconds=time.perf_counter() - start, optimize=optimize)


def _key(problem: PartitionProblem, sol: Solution) -> tuple[float, int]:
    ev = evaluate(problem, sol.assignment)
    return round(ev.bottleneck_ms, 9), ev.peak_memory_bytes


def _feasible(problem: PartitionProblem, sol: Solution) -> bool:
    return not assignment_violations(problem, sol.assignment)


def _solve(problem: PartitionProblem, solver: str, baselines: dict[str, Solution], bound: float,
           time_limit: float, optimize: str) -> Solution:
    if solver in BASELINES:
        sol = baselines[solver]
        bad = assignment_violations(problem, sol.assignment)
        if bad:
            raise InfeasibleError(f"the {solver!r} baseline breaks the constraints ({'; '.join(bad[:3])}); "
                                  "use solver='auto', which honours pins and memory limits")
        return sol
    dp: Solution | None = None
    dp_error: InfeasibleError | None = None
    try:
        dp = solve_chain_dp(problem, optimize=optimize, slack=_MEMORY_SLACK, lower_bound_ms=bound)
    except InfeasibleError as exc:
        dp_error = exc
    if solver == "dp" or (solver == "auto" and not _wants_cpsat(problem, dp)):
        if dp is None:
            assert dp_error is not None
            raise dp_error
        return dp
    hints = [s for s in [dp, *baselines.values()] if s is not None and _feasible(problem, s)]
    hint = min(hints, key=lambda s: _key(problem, s)) if hints else None
    remaining = max(0.5, time_limit - (dp.seconds if dp else 0.0))
    try:
        cp = solve_dag_cpsat(problem, hint=hint.assignment if hint else None, time_limit=remaining,
                             optimize=optimize, slack=_MEMORY_SLACK, lower_bound_ms=bound)
    except InfeasibleError:
        if dp_error is not None:
            raise dp_error from None
        raise
    except PartitionError:
        if dp is not None:
            return dp
        raise
    if dp is not None and _key(problem, dp) < _key(problem, cp) and solver == "auto":
        return replace(dp, bound_ms=cp.bound_ms if dp.bound_ms is None else max(dp.bound_ms, cp.bound_ms or 0),
                       status=dp.status + "; CP-SAT found nothing better")
    return cp


def _pick_best(problem: PartitionProblem, chosen: Solution, baselines: dict[str, Solution],
               step_ms: Callable[[tuple[int, ...]], float], optimize: str) -> Solution:
    """The solver's plan, or a feasible baseline's split where that is better by the exact cost.

    The baselines are contiguous splits, inside the DP's search space, but the DP prices
    skip connections approximately (Note [chain DP]), so on a branching graph a baseline
    can win; the plan is never worse than any of them. Speed: least bottleneck, ties
    (within ``_TIE_REL``) broken by the predicted step time, which adds the runtime's
    overheads. Memory: least peak memory among plans within the memory slack of the best
    bottleneck, ties broken the same way. A baseline that wins keeps the solver's name and
    bound (a bound holds for every plan) and is named in the status.
    """
    pool = [chosen] + [b for b in baselines.values() if _feasible(problem, b)]
    evals = [evaluate(problem, s.assignment) for s in pool]
    best = min(ev.bottleneck_ms for ev in evals)
    if optimize == "memory":
        # the slack is measured from the speed optimum (the chain DP proves it as its bound), not
        # from the solver's memory plan, which may itself already use the slack
        speed_opt = min(best, chosen.bound_ms) if chosen.bound_ms is not None and problem.is_chain else best
        keep = [0] + [i for i, ev in enumerate(evals)
                      if i and ev.bottleneck_ms <= speed_opt * (1 + _MEMORY_SLACK) + 1e-12]
        least = min(evals[i].peak_memory_bytes for i in keep)
        tied = [i for i in keep if evals[i].peak_memory_bytes == least]
    else:
        tied = [i for i, ev in enumerate(evals) if ev.bottleneck_ms <= best * (1 + _TIE_REL) + 1e-12]
    if 0 in tied and len(tied) == 1:
        return chosen
    steps = {i: step_ms(pool[i].assignment) for i in tied}
    win = min(tied, key=lambda i: (steps[i], i))   # the solver's own plan first on equal steps
    if win == 0:
        return chosen
    mine, theirs = evals[0], evals[win]
    if optimize == "memory" and theirs.peak_memory_bytes < mine.peak_memory_bytes:
        reason = f"less peak memory: {format_size(theirs.peak_memory_bytes)} vs {format_size(mine.peak_memory_bytes)}"
    elif theirs.bottleneck_ms < mine.bottleneck_ms * (1 - _TIE_REL):
        reason = f"faster by the exact cost: {theirs.bottleneck_ms:.4g} ms vs {mine.bottleneck_ms:.4g} ms bottleneck"
    else:
        reason = f"same bottleneck, faster predicted step: {steps[win]:.4g} ms vs {step_ms(chosen.assignment):.4g} ms"
    still_optimal = chosen.optimal and theirs.bottleneck_ms <= mine.bottleneck_ms * (1 + _TIE_REL) + 1e-12
    return replace(chosen, assignment=pool[win].assignment, optimal=still_optimal,
                   status=f"{chosen.status}; kept the {pool[win].solver} baseline's split ({reason})")


def _wants_cpsat(problem: PartitionProblem, dp: Solution | None) -> bool:
    """Auto runs CP-SAT when the DP is not exact (a branching graph) or could not fit the memory."""
    if dp is None:
        return True
    if problem.is_chain:
        return False
    size = problem.num_units * problem.num_stages * (1 + len(problem.tensors) / problem.num_units)
    return size <= CPSAT_MAX_VARIABLES


def _stage_plans(problem: PartitionProblem, assignment: tuple[int, ...], ev: Evaluation) -> tuple[StagePlan, ...]:
    members: list[list[str]] = [[] for _ in range(problem.num_stages)]
    for u, s in enumerate(assignment):
        members[s].append(problem.names[u])
    return tuple(
        StagePlan(
            index=i, units=tuple(members[i]), fwd_ms=st.fwd_ms, bwd_ms=st.bwd_ms, compute_ms=st.compute_ms,
            comm_fwd_ms=st.comm_fwd_ms, comm_bwd_ms=st.comm_bwd_ms, comm_ms=st.comm_ms, stage_ms=st.stage_ms,
            send_bytes=st.send_bytes, recv_bytes=st.recv_bytes, messages=st.messages,
            memory=StageMemory(params=st.param_bytes, grads=st.grad_bytes, optimizer=st.optimizer_bytes,
                               buffers=st.buffer_bytes, activations=st.activation_bytes, boundary=st.boundary_bytes),
            memory_bytes=st.memory_bytes, in_flight=st.in_flight, speed=problem.speeds[i],
            dp_allreduce_ms=st.dp_allreduce_ms, dp_bytes=st.dp_bytes,
        )
        for i, st in enumerate(ev.stages)
    )


def _baseline_report(problem: PartitionProblem, sol: Solution, plan_bottleneck: float,
                     microbatch_size: int, runtime: RuntimeCosts) -> BaselineReport:
    ev = evaluate(problem, sol.assignment)
    bad = assignment_violations(problem, sol.assignment, ev)
    pred = predict(problem, sol.assignment, microbatch_size, runtime=runtime)
    return BaselineReport(
        bottleneck_ms=ev.bottleneck_ms,
        ratio_to_plan=ev.bottleneck_ms / plan_bottleneck if plan_bottleneck > 0 else 1.0,
        stage_ms=tuple(s.stage_ms for s in ev.stages),
        memory_bytes=tuple(s.memory_bytes for s in ev.stages),
        units_per_stage=tuple(sol.assignment.count(s) for s in range(problem.num_stages)),
        step_ms=pred.step_ms[problem.schedule],
        feasible=not bad,
        violations=tuple(bad[:5]),
    )


def plan_from_assignment(profile: ModelProfile, problem: PartitionProblem, chosen: Solution,
                         baselines: dict[str, Solution], bound: float, bound_parts: dict[str, float], *,
                         seconds: float, optimize: str = "speed") -> PartitionPlan:
    """Assemble the plan for ``chosen``: exact costs, prediction, bound, gap and baselines."""
    bad = assignment_violations(problem, chosen.assignment)
    assert not bad, f"solver {chosen.solver} returned an invalid plan: {bad}"
    ev = evaluate(problem, chosen.assignment)
    bottleneck = ev.bottleneck_ms
    assert bound <= bottleneck * (1 + _BOUND_TOL) + 1e-12, (
        f"lower bound {bound} ms exceeds the {chosen.solver} plan's bottleneck {bottleneck} ms: {bound_parts}")
    bound = min(bound, bottleneck)  # only float noise is left to clip after the assert
    gap = (bottleneck - bound) / bound if bound > 0 else 0.0
    optimal = chosen.optimal or gap <= 1e-9
    status = chosen.status
    runtime = RUNTIME_COSTS.get(profile.trace_device, RUNTIME_COSTS["cpu"])
    if problem.memory_limit is not None:
        status += f"; peak memory {format_size(ev.peak_memory_bytes)} of {format_size(problem.memory_limit)}"
    return PartitionPlan(
        stages=_stage_plans(problem, chosen.assignment, ev),
        bottleneck_ms=bottleneck, lower_bound_ms=bound, gap=gap, optimal=optimal,
        solver=chosen.solver, solver_bound_ms=chosen.bound_ms, solve_seconds=seconds,
        schedule=problem.schedule, microbatches=problem.microbatches, num_stages=problem.num_stages,
        microbatch_size=profile.batch_size,
        baselines={name: _baseline_report(problem, sol, bottleneck, profile.batch_size, runtime)
                   for name, sol in baselines.items()},
        prediction=predict(problem, chosen.assignment, profile.batch_size, runtime=runtime),
        cost=problem.cost, memory_limit=problem.memory_limit, optimize=optimize,
        lower_bounds=dict(bound_parts), status=status.strip("; "),
    )
