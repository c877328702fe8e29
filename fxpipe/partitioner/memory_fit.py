"""Plans that fit the memory limit over the whole step, not only under the solvers' stage bound.

Note [fitting memory over time]: the solvers keep each rank under ``memory_limit`` with the
linear formula of Note [stage cost] (training state plus activations times the
microbatches in flight), which is fast to evaluate inside a DP or a CP-SAT model but is
not what the rank holds at its worst moment. The walk of the schedule's actions (Note
[memory over time]) also counts receive pools, sends kept to the step's end, backward
temporaries, gradients a split ``B`` keeps for its ``W`` and the step's inputs, so it is
mostly above the formula; but it can be below it, since the formula holds gradients and
every in-flight microbatch's activations at once, and a rank may never hold both (GPipe
peaks before its first backward has made any gradient). The walk is the limit that
counts. A plan whose walked peak is over the limit would run out of memory on the
device, so the planner solves again with the solvers' limit lowered by the excess
(``limit x memory_limit / peak``), at most ``ROUNDS`` more times, and keeps the first
plan whose walked peak fits. Tightening one bound for every rank can overshoot (the walk
exceeds the formula by a different share on each rank), and the formula can reject
every split that fits: so when no round fits, or the solvers find no split under the
limit at all, and the model has at most ``EXACT_MAX_SPLITS`` contiguous splits (and
walking them fits the plan's time limit, estimated from the first walks: a 70B profile's
walk takes ~6 ms, a small model's ~0.1 ms), the planner walks every one of them
(``fitting_split``) and keeps the fastest that fits.
Then "no split fits" is a fact, not a heuristic's give-up. The plan records the user's
limit; when nothing fits, the error says by how much the best plan misses and what to
change.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from fxpipe.errors import InfeasibleError
from fxpipe.partitioner.cost import format_size
from fxpipe.partitioner.pins import stage_ranges
from fxpipe.partitioner.plan import PartitionPlan
from fxpipe.partitioner.prediction import rank_peak_memory
from fxpipe.partitioner.problem import PartitionProblem, assignment_violations, evaluate

__all__ = ["fit_memory_over_time", "walked_peak", "fitting_split", "contiguous_splits", "ROUNDS",
           "EXACT_MAX_SPLITS"]

ROUNDS = 4
EXACT_MAX_SPLITS = 20_000  # contiguous splits the planner walks one by one when the rounds fail
_PRICED = 16               # fitting splits of least bottleneck whose step is simulated
_CHECK_EVERY = 8           # walks between checks that the rest fits the time budget
_ADVICE = ("raise the memory limit, add stages, plan with --devices N (its search recomputes activations where "
           "memory binds) or use more microbatches of fewer samples")


def walked_peak(plan: PartitionPlan) -> int:
    """The largest per-rank peak of ``plan``'s schedule walk (0 without a prediction)."""
    pred = plan.prediction
    return max(pred.peak_memory_bytes, default=0) if pred is not None else 0


def fit_memory_over_time(solve: Callable[[int], PartitionPlan], memory_limit: int,
                         check_every_split: Callable[[int], PartitionPlan | None] | None = None) -> PartitionPlan:
    """The plan ``solve(limit)`` makes for the largest ``limit <= memory_limit`` tried whose schedule
    walk fits ``memory_limit``; when none does, ``check_every_split(memory_limit)``'s plan (None:
    too many splits to walk) (Note [fitting memory over time])."""
    limit, peak = memory_limit, 0
    failure = ""
    for _ in range(ROUNDS + 1):
        try:
            plan = solve(limit)
        except InfeasibleError as exc:
            if limit == memory_limit:  # the stage bound can exceed the walk: check the walk itself
                try:
                    exact = check_every_split(memory_limit) if check_every_split is not None else None
                except InfeasibleError as walked:
                    raise InfeasibleError(f"{walked}; and under the solvers' stage bound {exc}") from exc
                if exact is None:
                    raise
                return _fitted(exact, memory_limit)
            failure = (f"the best plan under the solvers' stage bound peaks at {format_size(peak)} when its schedule "
                       f"runs (receive buffers, kept sends and backward temporaries included), and a tighter bound "
                       f"has no split")
            break
        peak = walked_peak(plan)
        if peak <= memory_limit:
            note = f"peak memory over the step {format_size(peak)} of {format_size(memory_limit)}"
            if limit < memory_limit:
                note += f" (solved under {format_size(limit)} so that the whole step fits)"
            return replace(plan, memory_limit=memory_limit, status=_with_note(plan.status, note))
        limit = min(limit - 1, int(limit * memory_limit / peak))
    else:
        failure = (f"after {ROUNDS} solves under tighter stage bounds the plan still peaks at {format_size(peak)} "
                   f"when its schedule runs")
    try:
        exact = check_every_split(memory_limit) if check_every_split is not None else None
    except InfeasibleError as walked:
        raise InfeasibleError(f"{walked}; {_ADVICE}") from None
    if exact is not None:
        return _fitted(exact, memory_limit)
    raise InfeasibleError(f"no split found that fits {format_size(memory_limit)} per device over the whole step: "
                          f"{failure}; {_ADVICE}")


def _fitted(plan: PartitionPlan, memory_limit: int) -> PartitionPlan:
    """``plan``, found by walking every split, under the user's limit."""
    note = (f"peak memory over the step {format_size(walked_peak(plan))} of {format_size(memory_limit)} "
            f"(the fastest contiguous split whose schedule walk fits)")
    return replace(plan, memory_limit=memory_limit, status=_with_note(plan.status, note))


def contiguous_splits(problem: PartitionProblem) -> Iterator[tuple[int, ...]]:
    """Every split of the units, in their topological order, into consecutive non-empty runs
    of ``problem.num_stages`` stages that honours the pins."""
    n, S = problem.num_units, problem.num_stages
    lo, hi = stage_ranges(problem)
    for cuts in itertools.combinations(range(1, n), S - 1):
        bounds = (0, *cuts, n)
        assignment = tuple(s for s in range(S) for _ in range(bounds[s + 1] - bounds[s]))
        if all(lo[u] <= s <= hi[u] for u, s in enumerate(assignment)):
            yield assignment


def fitting_split(problem: PartitionProblem, memory_limit: int, step_ms: Callable[[tuple[int, ...]], float],
                  budget_s: float = 10.0) -> tuple[int, ...] | None:
    """The contiguous split of least ``step_ms`` whose every rank's schedule walk fits
    ``memory_limit`` (Note [fitting memory over time]); None when the model has more than
    ``EXACT_MAX_SPLITS`` such splits, or more than walking them takes in ``budget_s`` seconds
    (estimated from the first walks). Raises ``InfeasibleError`` when none fits."""
    total = math.comb(problem.num_units - 1, problem.num_stages - 1)
    if total > EXACT_MAX_SPLITS:
        return None
    problem = replace(problem, memory_limit=None)  # the walk is the limit (the stage bound may exceed it)
    fits: list[tuple[float, int, tuple[int, ...]]] = []
    least: int | None = None
    start = time.perf_counter()
    for walked, a in enumerate(contiguous_splits(problem), 1):
        peak = max(rank_peak_memory(problem, a))
        least = peak if least is None else min(least, peak)
        if peak <= memory_limit and not assignment_violations(problem, a):
            fits.append((evaluate(problem, a).bottleneck_ms, len(fits), a))
        if walked % _CHECK_EVERY == 0 and (time.perf_counter() - start) / walked * total > budget_s:
            return None
    if least is None:
        raise InfeasibleError(f"no contiguous split of the {problem.num_units} units into {problem.num_stages} "
                              f"stages honours the pins")
    if not fits:
        raise InfeasibleError(
            f"no split fits {format_size(memory_limit)} per device over the whole step: the least any contiguous "
            f"split holds is {format_size(least)} (every split's schedule walk checked)")
    return min(heapq.nsmallest(_PRICED, fits), key=lambda f: (step_ms(f[2]), f[0], f[1]))[2]


def _with_note(status: str, note: str) -> str:
    """``status`` with its stage-bound memory clause replaced by ``note``."""
    parts = [p for p in status.split("; ") if p and not p.startswith("peak memory ")]
    return "; ".join(parts + [note])
