"""``plan_partition``: profile in, ``PartitionPlan`` out (solver choice, bound, baselines, prediction).

Orchestration only: build the problem, run the solvers, keep the split with the least
predicted step time of the schedule (Note [planning for step time] in
``fxpipe.partitioner.solve.refine``), and price it (``fxpipe.partitioner.prediction``, Note
[step prediction]). ``schedule="auto"`` plans every schedule and keeps the fastest
(``fxpipe.partitioner.solve.auto``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from fxpipe.errors import InfeasibleError, PartitionError
from fxpipe.partitioner.solve.baselines import BASELINES, run_baseline
from fxpipe.partitioner.solve.auto import plan_auto
from fxpipe.partitioner.solve.solution import lower_bound
from fxpipe.partitioner.cost import CostModel, default_link, format_size
from fxpipe.partitioner.solve.cpsat import solve_dag_cpsat
from fxpipe.partitioner.solve.dp import solve_chain_dp
from fxpipe.partitioner.solve.memory_fit import fit_memory_over_time, fitting_split, walk_violations
from fxpipe.partitioner.solve.pin_ranges import stage_ranges
from fxpipe.partitioner.plan import BaselineReport, PartitionPlan, StageMemory, StagePlan
from fxpipe.partitioner.prediction import (
    RuntimeCosts,
    predict,
    runtime_costs_for,
    simulate_plan,
    step_overheads,
)
from fxpipe.partitioner.problem import (
    Evaluation,
    PartitionProblem,
    assignment_violations,
    build_problem,
    evaluate,
)
from fxpipe.partitioner.solve.refine import is_contiguous, refine_split
from fxpipe.partitioner.schedule import AUTO
from fxpipe.partitioner.solve.solution import Solution
from fxpipe.partitioner.solve.split_points import pin_split_points
from fxpipe.partitioner.seqlen import priced_lengths
from fxpipe.tracer.profile import ModelProfile

__all__ = [
    "plan_partition",
    "plan_from_assignment",
    "SOLVERS",
    "CPSAT_MAX_VARIABLES",
    "step_time_of",
]

SOLVERS = ("auto", "dp", "cpsat", *BASELINES)
CPSAT_MAX_VARIABLES = 200_000  # auto skips CP-SAT above units x stages x (1 + tensors/unit)
_MEMORY_SLACK = 0.01  # optimize="memory" may give up 1% of speed
_TIE_REL = 1e-9  # bottlenecks this close (relative) are equal; the predicted step decides
_BOUND_TOL = 1e-6  # a lower bound may exceed the plan's bottleneck by float noise only
_PRICING_SHARE = 0.1  # of the time limit, kept for pricing the plan after CP-SAT
_MIN_CPSAT_S = 0.05  # less than this left: auto skips CP-SAT
_REFINE_SHARE = 0.25  # of the time limit, kept for the local search for step time (at most 2 s)


def step_time_of(
    problem: PartitionProblem, runtime: RuntimeCosts
) -> Callable[[tuple[int, ...]], float]:
    """The planner's objective: a split's predicted step time under ``problem.schedule``."""

    def step_ms(assignment: tuple[int, ...]) -> float:
        ev = evaluate(problem, assignment)
        line = simulate_plan(problem, assignment, runtime, evaluation=ev)
        return line.step_ms + step_overheads(problem, assignment, runtime).total_ms

    return step_ms


def plan_partition(
    profile: ModelProfile,
    num_stages: int,
    *,
    solver: str = "auto",
    schedule: str = "1f1b",
    microbatches: int = 1,
    cost: CostModel | None = None,
    memory_limit: int | None = None,
    time_limit: float = 10.0,
    optimize: str = "speed",
    virtual_stages: int | None = None,
    objective: str = "step",
    split_at: Sequence[str] = (),
) -> PartitionPlan:
    """Split ``profile``'s units into ``num_stages`` pipeline ranks of ``virtual_stages`` stages each.

    The objective is the predicted step time of ``schedule`` (Note [planning for step
    time]); ``schedule="auto"`` plans every schedule (and stages per rank) that fits and
    keeps the fastest, listing the others in ``plan.alternatives``. ``solver``: ``auto``
    (exact DP on contiguous splits, then CP-SAT over the DAG when the graph branches or
    the memory limit binds, within ``time_limit`` seconds; the better plan wins), ``dp``,
    ``cpsat``, or a baseline (``uniform``, ``params``, ``greedy``). The solvers minimise
    the bottleneck stage time (``plan.optimal`` says whether that is proven); the plan
    is then, among the solver's, the baselines' and a local search from the best of them,
    the split with the least bottleneck of those whose predicted step is within the
    prediction's resolution (5%) of the least, so it is never predicted slower than a
    baseline by more than that.
    ``optimize="memory"`` minimises peak memory among plans within 1% of the best
    bottleneck. ``objective="bottleneck"`` keeps the least bottleneck instead of the least
    predicted step (equal bottlenecks still go to the faster predicted step). The baselines
    are always evaluated and reported beside the plan.
    ``time_limit`` bounds the whole call: CP-SAT gets what the steps before it left, less
    what the local search and the pricing keep (Note [CP-SAT time budget] in
    ``fxpipe.partitioner.solve.cpsat``); the exact DP and the baselines, which every plan needs,
    always run to the end. ``cost`` defaults to the link of the trace device
    (``default_link``). ``split_at``: module paths where stages begin (``--split-at``;
    ``fxpipe.partitioner.solve.split_points``), one fewer than the stages; the solvers honour them as pins.
    ``memory_limit`` holds each rank's peak over the whole step (the schedule walk), solving
    again under a tighter stage bound where needed (Note [fitting memory over time]).

    >>> plan = plan_partition(profile, 4, microbatches=8, memory_limit=parse_size("16GiB"))  # doctest: +SKIP
    >>> plan.stage_of("blocks.3"), plan.step_ms, plan.gap                                    # doctest: +SKIP
    """
    if schedule == AUTO:
        return plan_auto(
            plan_partition,
            profile,
            num_stages,
            solver=solver,
            microbatches=microbatches,
            cost=cost,
            memory_limit=memory_limit,
            time_limit=time_limit,
            optimize=optimize,
            virtual_stages=virtual_stages,
            objective=objective,
            split_at=split_at,
        )
    if solver not in SOLVERS:
        raise PartitionError(f"unknown solver {solver!r}; expected one of {list(SOLVERS)}")
    if optimize not in ("speed", "memory"):
        raise PartitionError(f"optimize must be 'speed' or 'memory', got {optimize!r}")
    if objective not in ("step", "bottleneck"):
        raise PartitionError(f"objective must be 'step' or 'bottleneck', got {objective!r}")
    if not (isinstance(time_limit, (int, float)) and math.isfinite(time_limit) and time_limit > 0):
        raise PartitionError(
            f"time_limit must be a finite number of seconds > 0, got {time_limit!r}"
        )
    cost = cost or CostModel.preset(default_link(profile.trace_device))

    def plan_split(
        limit: int | None, walk_limit: int | None = None, baselines_walk: int | None = None
    ) -> PartitionPlan | None:
        return _plan_split(
            profile,
            num_stages,
            solver=solver,
            schedule=schedule,
            microbatches=microbatches,
            cost=cost,
            memory_limit=limit,
            time_limit=time_limit,
            optimize=optimize,
            virtual_stages=virtual_stages,
            objective=objective,
            split_at=split_at,
            walk_limit=walk_limit,
            baselines_walk=baselines_walk,
        )

    def plan_under(limit: int | None, baselines_walk: int | None = None) -> PartitionPlan:
        plan = plan_split(limit, baselines_walk=baselines_walk)
        assert plan is not None  # only a walk over every split gives up
        return plan

    if memory_limit is not None and solver not in BASELINES:
        reserved = runtime_costs_for(
            profile.trace_device
        ).workspace_bytes  # library workspaces: not host speed
        return fit_memory_over_time(
            plan_under,
            memory_limit,
            lambda limit: plan_split(None, walk_limit=limit),
            solve_loosened=lambda limit: plan_under(limit, baselines_walk=memory_limit),
            reserved=reserved,
        )
    return plan_under(memory_limit)


def _plan_split(
    profile: ModelProfile,
    num_stages: int,
    *,
    solver: str,
    schedule: str,
    microbatches: int,
    cost: CostModel,
    memory_limit: int | None,
    time_limit: float,
    optimize: str,
    virtual_stages: int | None,
    objective: str,
    split_at: Sequence[str],
    walk_limit: int | None = None,
    baselines_walk: int | None = None,
) -> PartitionPlan | None:
    """``plan_partition`` for one schedule, with the solvers' memory bound at ``memory_limit``.
    With ``walk_limit`` (and no ``memory_limit``), the split is instead the fastest contiguous one
    whose schedule walk fits it, every split checked (``fitting_split``; None when there are too
    many to check). The baselines are held to the walk under ``walk_limit``, or ``baselines_walk``
    (a plan solved under a loosened bound, Note [fitting memory over time])."""
    start = time.perf_counter()
    problem = build_problem(
        profile,
        num_stages,
        schedule=schedule,
        microbatches=microbatches,
        cost=cost,
        memory_limit=memory_limit,
        virtual_stages=virtual_stages,
    )
    problem = pin_split_points(problem, split_at, profile.module_order)
    stage_ranges(problem)  # contradictory pins fail here, before any solver runs
    baselines = {name: run_baseline(name, problem) for name in BASELINES}
    bound, parts = lower_bound(problem)
    runners_up: list[Solution] = []
    runtime = runtime_costs_for(profile.trace_device, profile.host_slowdown)
    step_ms = step_time_of(problem, runtime)
    if walk_limit is not None:
        found = fitting_split(
            problem,
            walk_limit,
            step_ms,
            budget_s=time_limit,
            optimize=optimize,
            objective=objective,
            slack=_MEMORY_SLACK,
            runtime=runtime,
        )
        if found is None:
            return None
        chosen = Solution(
            found,
            solver="all-splits",
            status="every contiguous split's schedule walk checked against the memory limit",
        )
    else:
        chosen = _solve(
            problem, solver, baselines, bound, start + time_limit, time_limit, optimize, runners_up
        )
    if solver not in BASELINES and walk_limit is None:
        if optimize == "memory" or objective == "bottleneck":
            chosen = _pick_best(problem, chosen, baselines, step_ms, optimize)
        else:
            left = start + time_limit - time.perf_counter() - _PRICING_SHARE * time_limit
            budget = max(0.0, min(_refine_budget(time_limit), left))
            chosen = _pick_fastest(
                problem,
                chosen,
                {**baselines, **{s.solver: s for s in runners_up}},
                step_ms,
                budget,
                runtime.step_resolution,
            )
    proven = {f"{chosen.solver}_proven": chosen.bound_ms} if chosen.bound_ms is not None else {}
    bound, parts = lower_bound(problem, proven=proven)
    for_step = optimize == "speed" and objective == "step" and solver not in BASELINES
    plan = plan_from_assignment(
        profile,
        problem,
        chosen,
        baselines,
        bound,
        parts,
        seconds=time.perf_counter() - start,
        optimize=optimize,
        objective="step" if for_step else "bottleneck",
    )
    held_to = walk_limit if walk_limit is not None else baselines_walk
    if held_to is not None:  # the baselines, too, are held to the walk, not the stage formula
        plan = replace(
            plan,
            baselines={
                name: _walked_baseline(
                    report, problem, baselines[name].assignment, held_to, runtime
                )
                for name, report in plan.baselines.items()
            },
        )
    if split_at:
        plan = replace(
            plan,
            status=f"{plan.status}; stages start at --split-at {', '.join(split_at)}".strip("; "),
        )
    return plan


def _walked_baseline(
    report: BaselineReport,
    problem: PartitionProblem,
    assignment: tuple[int, ...],
    walk_limit: int,
    runtime: RuntimeCosts,
) -> BaselineReport:
    """``report`` with the ranks whose schedule walk is over ``walk_limit`` added to its violations."""
    over = walk_violations(problem, assignment, walk_limit, runtime)
    if not over:
        return report
    return replace(report, feasible=False, violations=(report.violations + tuple(over))[:5])


def _refine_budget(time_limit: float) -> float:
    """Seconds of ``time_limit`` the local search for step time may use."""
    return min(2.0, _REFINE_SHARE * time_limit)


def _key(problem: PartitionProblem, sol: Solution) -> tuple[float, int]:
    ev = evaluate(problem, sol.assignment)
    return round(ev.bottleneck_ms, 9), ev.peak_memory_bytes


def _feasible(problem: PartitionProblem, sol: Solution) -> bool:
    return not assignment_violations(problem, sol.assignment)


def _solve(
    problem: PartitionProblem,
    solver: str,
    baselines: dict[str, Solution],
    bound: float,
    deadline: float,
    time_limit: float,
    optimize: str,
    runners_up: list[Solution],
) -> Solution:
    """The solver's split (least bottleneck); another solver's split it beat goes to ``runners_up``.
    CP-SAT gets what is left of ``time_limit`` (which started at ``deadline - time_limit``)
    after the DP, less the shares kept for the local search and the pricing (Note [CP-SAT time budget])."""
    if solver in BASELINES:
        sol = baselines[solver]
        bad = assignment_violations(problem, sol.assignment)
        if bad:
            raise InfeasibleError(
                f"the {solver!r} baseline breaks the constraints ({'; '.join(bad[:3])}); "
                "use solver='auto', which honours pins and memory limits"
            )
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
    remaining = (
        deadline - time.perf_counter() - _PRICING_SHARE * time_limit - _refine_budget(time_limit)
    )
    if remaining < _MIN_CPSAT_S and hint is not None and solver == "auto":
        best = dp if dp is not None else hint
        return replace(
            best, status=f"{best.status}; no time left for CP-SAT within the {time_limit:g} s limit"
        )
    try:
        cp = solve_dag_cpsat(
            problem,
            hint=hint.assignment if hint else None,
            time_limit=max(remaining, _MIN_CPSAT_S),
            optimize=optimize,
            slack=_MEMORY_SLACK,
            lower_bound_ms=bound,
        )
    except InfeasibleError:
        if dp_error is not None:
            raise dp_error from None
        raise
    except PartitionError:
        if dp is not None:
            return dp
        raise
    if dp is not None and _key(problem, dp) < _key(problem, cp) and solver == "auto":
        runners_up.append(cp)
        return replace(
            dp,
            bound_ms=cp.bound_ms if dp.bound_ms is None else max(dp.bound_ms, cp.bound_ms or 0),
            status=dp.status + "; CP-SAT found nothing better",
        )
    if dp is not None:
        runners_up.append(dp)
    return cp


def _pick_best(
    problem: PartitionProblem,
    chosen: Solution,
    baselines: dict[str, Solution],
    step_ms: Callable[[tuple[int, ...]], float],
    optimize: str,
) -> Solution:
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
        speed_opt = (
            min(best, chosen.bound_ms) if chosen.bound_ms is not None and problem.is_chain else best
        )
        keep = [0] + [
            i
            for i, ev in enumerate(evals)
            if i and ev.bottleneck_ms <= speed_opt * (1 + _MEMORY_SLACK) + 1e-12
        ]
        least = min(evals[i].peak_memory_bytes for i in keep)
        tied = [i for i in keep if evals[i].peak_memory_bytes == least]
    else:
        tied = [
            i for i, ev in enumerate(evals) if ev.bottleneck_ms <= best * (1 + _TIE_REL) + 1e-12
        ]
    if 0 in tied and len(tied) == 1:
        return chosen
    steps = {i: step_ms(pool[i].assignment) for i in tied}
    win = min(tied, key=lambda i: (steps[i], i))  # the solver's own plan first on equal steps
    if win == 0:
        return chosen
    mine, theirs = evals[0], evals[win]
    if optimize == "memory" and theirs.peak_memory_bytes < mine.peak_memory_bytes:
        reason = f"less peak memory: {format_size(theirs.peak_memory_bytes)} vs {format_size(mine.peak_memory_bytes)}"
    elif theirs.bottleneck_ms < mine.bottleneck_ms * (1 - _TIE_REL):
        reason = f"faster by the exact cost: {theirs.bottleneck_ms:.4g} ms vs {mine.bottleneck_ms:.4g} ms bottleneck"
    else:
        reason = f"same bottleneck, faster predicted step: {steps[win]:.4g} ms vs {step_ms(chosen.assignment):.4g} ms"
    still_optimal = (
        chosen.optimal and theirs.bottleneck_ms <= mine.bottleneck_ms * (1 + _TIE_REL) + 1e-12
    )
    return replace(
        chosen,
        assignment=pool[win].assignment,
        optimal=still_optimal,
        status=f"{_status_of(chosen, still_optimal, mine.bottleneck_ms)}; kept the {pool[win].solver} "
        f"baseline's split ({reason})",
    )


def _pick_fastest(
    problem: PartitionProblem,
    chosen: Solution,
    baselines: dict[str, Solution],
    step_ms: Callable[[tuple[int, ...]], float],
    budget_s: float,
    resolution: float = 0.0,
) -> Solution:
    """The split the predicted step (Note [planning for step time]) tells apart as fastest, among the
    solver's, the feasible baselines' and a local search from the best contiguous one: of the splits
    whose predicted step is within ``resolution`` (relative) of the least, the one with the least
    bottleneck, ties to the faster predicted step, then to the solver's own. A winner other than the
    solver's keeps its name and bound (a bound holds for every plan) and is named in the status."""
    pool = [chosen] + [b for b in baselines.values() if _feasible(problem, b)]
    steps = [step_ms(s.assignment) for s in pool]
    contiguous = [
        i
        for i in sorted(range(len(pool)), key=lambda i: (steps[i], i))
        if is_contiguous(pool[i].assignment)
    ]
    if contiguous and problem.num_stages > 1:
        seed = contiguous[0]
        refined, value, _ = refine_split(problem, pool[seed].assignment, step_ms, budget_s=budget_s)
        if value < steps[seed] * (1 - _TIE_REL):
            pool.append(replace(pool[seed], assignment=refined, solver="refined"))
            steps.append(value)
    evals = [evaluate(problem, s.assignment) for s in pool]
    best = min(steps)
    near = [i for i, v in enumerate(steps) if v <= best * (1 + max(resolution, _TIE_REL)) + 1e-12]
    least = min(evals[i].bottleneck_ms for i in near)
    win = min(
        (i for i in near if evals[i].bottleneck_ms <= least * (1 + _TIE_REL) + 1e-12),
        key=lambda i: (steps[i], i),
    )
    fastest = min(range(len(pool)), key=lambda i: (steps[i], i))
    count = f"best predicted step of {len(pool)} candidate splits"
    if resolution > 0 and win != fastest:
        count = (
            f"least bottleneck of the {len(near)} of {len(pool)} candidate splits predicted within "
            f"{resolution:.0%} of the fastest step ({best:.4g} ms), closer than the prediction orders splits"
        )
    if win == 0:
        return replace(chosen, status=f"{chosen.status}; {count}")
    mine, theirs = evals[0], evals[win]
    step_text = f"{steps[win]:.4g} ms vs {steps[0]:.4g} ms predicted step"
    if pool[win].solver == "refined":
        source = f"a local search for step time from the {pool[seed].solver} split"
        reason = (
            f"{step_text}; bottleneck {theirs.bottleneck_ms:.4g} ms vs {mine.bottleneck_ms:.4g} ms"
        )
    else:
        what = "baseline's split" if pool[win].solver in BASELINES else "split"
        source = f"the {pool[win].solver} {what}"
        if theirs.bottleneck_ms < mine.bottleneck_ms * (1 - _TIE_REL):
            reason = (
                f"faster by the exact cost: {theirs.bottleneck_ms:.4g} ms vs {mine.bottleneck_ms:.4g} ms "
                f"bottleneck, {step_text}"
            )
        elif theirs.bottleneck_ms <= mine.bottleneck_ms * (1 + _TIE_REL) + 1e-12:
            reason = (
                f"same bottleneck, faster predicted step: {steps[win]:.4g} ms vs {steps[0]:.4g} ms"
            )
        else:
            reason = f"faster predicted step: {step_text}, though its bottleneck is {theirs.bottleneck_ms:.4g} ms"
    still_optimal = (
        chosen.optimal and theirs.bottleneck_ms <= mine.bottleneck_ms * (1 + _TIE_REL) + 1e-12
    )
    return replace(
        chosen,
        assignment=pool[win].assignment,
        optimal=still_optimal,
        status=f"{_status_of(chosen, still_optimal, mine.bottleneck_ms)}; kept {source} ({reason}); {count}",
    )


def _status_of(chosen: Solution, still_optimal: bool, bottleneck_ms: float) -> str:
    """The solver's status, saying of which split a proof speaks when the plan keeps another, slower one."""
    if not chosen.optimal or still_optimal:
        return chosen.status
    return f"{chosen.status} for the {chosen.solver} split's bottleneck ({bottleneck_ms:.4g} ms)"


def _wants_cpsat(problem: PartitionProblem, dp: Solution | None) -> bool:
    """Auto runs CP-SAT when the DP is not exact (a branching graph) or could not fit the memory."""
    if dp is None:
        return True
    if problem.is_chain:
        return False
    size = problem.num_units * problem.num_stages * (1 + len(problem.tensors) / problem.num_units)
    return size <= CPSAT_MAX_VARIABLES


def _stage_plans(
    problem: PartitionProblem, assignment: tuple[int, ...], ev: Evaluation
) -> tuple[StagePlan, ...]:
    members: list[list[str]] = [[] for _ in range(problem.num_stages)]
    for u, s in enumerate(assignment):
        members[s].append(problem.names[u])
    return tuple(
        StagePlan(
            index=i,
            units=tuple(members[i]),
            fwd_ms=st.fwd_ms,
            bwd_ms=st.bwd_ms,
            compute_ms=st.compute_ms,
            comm_fwd_ms=st.comm_fwd_ms,
            comm_bwd_ms=st.comm_bwd_ms,
            comm_ms=st.comm_ms,
            stage_ms=st.stage_ms,
            send_bytes=st.send_bytes,
            recv_bytes=st.recv_bytes,
            messages=st.messages,
            memory=StageMemory(
                params=st.param_bytes,
                grads=st.grad_bytes,
                optimizer=st.optimizer_bytes,
                buffers=st.buffer_bytes,
                activations=st.activation_bytes,
                boundary=st.boundary_bytes,
            ),
            memory_bytes=st.memory_bytes,
            in_flight=st.in_flight,
            speed=problem.speeds[i],
            dp_allreduce_ms=st.dp_allreduce_ms,
            dp_bytes=st.dp_bytes,
            bwd_weight_ms=st.bwd_weight_ms,
            rank=st.rank,
        )
        for i, st in enumerate(ev.stages)
    )


def _baseline_report(
    problem: PartitionProblem,
    sol: Solution,
    plan_bottleneck: float,
    microbatch_size: int,
    runtime: RuntimeCosts,
) -> BaselineReport:
    ev = evaluate(problem, sol.assignment)
    bad = assignment_violations(problem, sol.assignment, ev)
    pred = predict(problem, sol.assignment, microbatch_size, runtime=runtime)
    return BaselineReport(
        bottleneck_ms=ev.bottleneck_ms,
        ratio_to_plan=ev.bottleneck_ms / plan_bottleneck if plan_bottleneck > 0 else 1.0,
        stage_ms=tuple(s.stage_ms for s in ev.stages),
        memory_bytes=ev.rank_memory_bytes,
        units_per_stage=tuple(sol.assignment.count(s) for s in range(problem.num_stages)),
        step_ms=pred.step_ms[problem.schedule],
        feasible=not bad,
        violations=tuple(bad[:5]),
    )


def plan_from_assignment(
    profile: ModelProfile,
    problem: PartitionProblem,
    chosen: Solution,
    baselines: dict[str, Solution],
    bound: float,
    bound_parts: dict[str, float],
    *,
    seconds: float,
    optimize: str = "speed",
    objective: str = "bottleneck",
) -> PartitionPlan:
    """Assemble the plan for ``chosen``: exact costs, prediction, bound, gap and baselines."""
    bad = assignment_violations(problem, chosen.assignment)
    assert not bad, f"solver {chosen.solver} returned an invalid plan: {bad}"
    ev = evaluate(problem, chosen.assignment)
    bottleneck = ev.bottleneck_ms
    assert bound <= bottleneck * (1 + _BOUND_TOL) + 1e-12, (
        f"lower bound {bound} ms exceeds the {chosen.solver} plan's bottleneck {bottleneck} ms: {bound_parts}"
    )
    bound = min(bound, bottleneck)  # only float noise is left to clip after the assert
    gap = (bottleneck - bound) / bound if bound > 0 else 0.0
    optimal = chosen.optimal or gap <= 1e-9
    status = chosen.status
    runtime = runtime_costs_for(profile.trace_device, profile.host_slowdown)
    if problem.memory_limit is not None:
        status += f"; peak memory {format_size(ev.peak_memory_bytes)} of {format_size(problem.memory_limit)}"
    return PartitionPlan(
        stages=_stage_plans(problem, chosen.assignment, ev),
        bottleneck_ms=bottleneck,
        lower_bound_ms=bound,
        gap=gap,
        optimal=optimal,
        solver=chosen.solver,
        solver_bound_ms=chosen.bound_ms,
        solve_seconds=seconds,
        schedule=problem.schedule,
        microbatches=problem.microbatches,
        num_stages=problem.num_stages,
        microbatch_size=profile.batch_size,
        baselines={
            name: _baseline_report(problem, sol, bottleneck, profile.batch_size, runtime)
            for name, sol in baselines.items()
        },
        prediction=predict(problem, chosen.assignment, profile.batch_size, runtime=runtime),
        cost=problem.cost,
        memory_limit=problem.memory_limit,
        optimize=optimize,
        lower_bounds=dict(bound_parts),
        status=status.strip("; "),
        virtual_stages=problem.virtual_stages,
        placement=problem.placement,
        objective=objective,
        rank_memory_bytes=ev.rank_memory_bytes,
        unit_times=f"{profile.trace_device} {profile.timing}",
        compiled=profile.compiled,
        compile_factor=profile.compile_factor,
        priced_at=priced_lengths(profile),
    )
