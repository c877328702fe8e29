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
limit at all, and the model has at most ``EXACT_MAX_SPLITS`` contiguous splits that
honour the pins (counted without listing them, ``count_contiguous_splits``) and walking
them fits the plan's time limit (estimated from the first walks: a 70B profile's walk
takes ~6 ms, a small model's ~0.1 ms), the planner walks every one of them
(``fitting_split``) and keeps the best that fits by the plan's objective; the baselines
beside it are then held to the walk as well. On a chain every valid split is contiguous,
so "no split fits" is then a fact, not a heuristic's give-up; on a branching graph a
split that is not contiguous in the unit order might still fit, and the error says so.
Where the solvers find no split under the limit and there are too many splits to walk,
the planner loosens the solvers' bound instead: the unbounded plan if its walk fits,
else the loosest bound (bisected between the limit and that plan's formula peak) whose
plan's walk fits. The cluster search keeps a configuration by its walk (Note [cluster
search]), so the plan of one it chose is found this way even where the formula would
have rejected it. The plan records the user's limit; when nothing fits, the error says by how much the
best plan misses and what to change.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from fxpipe.errors import InfeasibleError
from fxpipe.partitioner.cost import format_size
from fxpipe.partitioner.solve.pin_ranges import stage_ranges
from fxpipe.partitioner.plan import PartitionPlan
from fxpipe.partitioner.prediction import RuntimeCosts, rank_peak_memory
from fxpipe.partitioner.problem import PartitionProblem, assignment_violations, evaluate

__all__ = [
    "fit_memory_over_time",
    "walked_peak",
    "fitting_split",
    "contiguous_splits",
    "count_contiguous_splits",
    "walk_violations",
    "ROUNDS",
    "EXACT_MAX_SPLITS",
]

ROUNDS = 4
EXACT_MAX_SPLITS = 20_000  # contiguous splits the planner walks one by one when the rounds fail
_PRICED = 16  # fitting splits of least bottleneck whose step is simulated
_CHECK_EVERY = 8  # walks between checks that the rest fits the time budget
_ADVICE = (
    "raise the memory limit, add stages, plan with --devices N (its search recomputes activations where "
    "memory binds) or use more microbatches of fewer samples"
)


def walked_peak(plan: PartitionPlan) -> int:
    """The largest per-rank peak of ``plan``'s schedule walk (0 without a prediction)."""
    pred = plan.prediction
    return max(pred.peak_memory_bytes, default=0) if pred is not None else 0


def fit_memory_over_time(
    solve: Callable[[int | None], PartitionPlan],
    memory_limit: int,
    check_every_split: Callable[[int], PartitionPlan | None],
    solve_loosened: Callable[[int | None], PartitionPlan] | None = None,
    reserved: int = 0,
) -> PartitionPlan:
    """The plan ``solve(limit)`` makes for the largest ``limit <= memory_limit`` tried whose schedule
    walk fits ``memory_limit``; when none does, ``check_every_split(memory_limit)``'s plan; when
    the solvers find no split at the limit and there are too many to walk, the plan of a looser
    bound whose walk fits (``solve_loosened``, default ``solve``: it holds the baselines to the
    walk) (Note [fitting memory over time]). ``reserved``: bytes every walk holds that the
    solvers' stage formula leaves out (the CUDA libraries' workspaces), taken off the first bound."""
    first = memory_limit - reserved if 0 < reserved < memory_limit else memory_limit
    limit, peak = first, 0
    failure = ""
    for _ in range(ROUNDS + 1):
        try:
            plan = solve(limit)
        except InfeasibleError as exc:
            if limit == first:  # the stage bound can exceed the walk: check the walk itself
                try:
                    exact = check_every_split(memory_limit)
                except InfeasibleError as walked:
                    raise InfeasibleError(
                        f"{walked}. Under the solvers' stage formula: {exc}"
                    ) from walked
                if exact is None:
                    looser = _under_looser_bound(solve_loosened or solve, memory_limit)
                    if looser is None:
                        raise InfeasibleError(
                            f"{exc}; nor does any plan solved under a looser stage bound fit "
                            f"{format_size(memory_limit)} over the whole step (too many "
                            f"contiguous splits to walk each)"
                        ) from exc
                    return looser
                return _fitted(exact, memory_limit)
            failure = (
                f"the best plan under the solvers' stage bound peaks at {format_size(peak)} when its schedule "
                f"runs (receive buffers, kept sends and backward temporaries included), and a tighter bound "
                f"has no split"
            )
            break
        peak = walked_peak(plan)
        if peak <= memory_limit:
            note = f"peak memory over the step {format_size(peak)} of {format_size(memory_limit)}"
            if limit < memory_limit:
                note += f" (solved under {format_size(limit)} so that the whole step fits)"
            return replace(plan, memory_limit=memory_limit, status=_with_note(plan.status, note))
        limit = min(limit - 1, int(limit * memory_limit / peak))
    else:
        failure = (
            f"after {ROUNDS} solves under tighter stage bounds the plan still peaks at {format_size(peak)} "
            f"when its schedule runs"
        )
    try:
        exact = check_every_split(memory_limit)
    except InfeasibleError as walked:
        raise InfeasibleError(f"{walked}; {_ADVICE}") from walked
    if exact is not None:
        return _fitted(exact, memory_limit)
    raise InfeasibleError(
        f"no split found that fits {format_size(memory_limit)} per device over the whole step: "
        f"{failure} (the model has too many contiguous splits to walk each within the time limit: "
        f"a larger --time-limit walks more); {_ADVICE}"
    )


def _under_looser_bound(
    solve: Callable[[int | None], PartitionPlan], memory_limit: int
) -> PartitionPlan | None:
    """A plan whose walk fits ``memory_limit`` though the solvers' formula put every split over
    it (the formula can exceed the walk): the unbounded plan, or the loosest bound between the
    limit and that plan's formula peak whose plan fits (bisection, ``ROUNDS`` solves); None if none."""
    try:
        plan = solve(None)
    except InfeasibleError:
        return None
    if walked_peak(plan) <= memory_limit:
        return _fitted(plan, memory_limit)
    lo, hi, best = memory_limit, max(plan.rank_memory_bytes), None
    for _ in range(ROUNDS):
        mid = (lo + hi) // 2
        if mid <= lo:
            break
        try:
            plan = solve(mid)
        except InfeasibleError:
            lo = mid
            continue
        if walked_peak(plan) <= memory_limit:
            best, lo = plan, mid
        else:
            hi = mid
    return _fitted(best, memory_limit) if best is not None else None


def _fitted(plan: PartitionPlan, memory_limit: int) -> PartitionPlan:
    """``plan``, whose walk fits though the solvers' formula may not, under the user's limit."""
    note = (
        f"peak memory over the step {format_size(walked_peak(plan))} of {format_size(memory_limit)} "
        f"(the table's rank peak; the solvers' stage formula, its memory column, may exceed it)"
    )
    return replace(plan, memory_limit=memory_limit, status=_with_note(plan.status, note))


def contiguous_splits(problem: PartitionProblem) -> Iterator[tuple[int, ...]]:
    """Every split of the units, in their topological order, into consecutive non-empty runs
    of ``problem.num_stages`` stages that honours the pins (only those are generated)."""
    n, S = problem.num_units, problem.num_stages
    lo, hi = stage_ranges(problem)
    ways = _completions(lo, hi, S)

    def extend(s: int, start: int, prefix: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        if s == S - 1:
            yield prefix + (s,) * (n - start)
            return
        end = start + 1
        while end <= n and lo[end - 1] <= s <= hi[end - 1]:
            if ways[s + 1][end]:
                yield from extend(s + 1, end, prefix + (s,) * (end - start))
            end += 1

    if ways[0][0]:
        yield from extend(0, 0, ())


def count_contiguous_splits(problem: PartitionProblem) -> int:
    """How many splits ``contiguous_splits`` generates, counted without generating them."""
    lo, hi = stage_ranges(problem)
    return _completions(lo, hi, problem.num_stages)[0][0]


def _completions(lo: list[int], hi: list[int], num_stages: int) -> list[list[int]]:
    """``ways[s][u]``: the splits of units ``u..`` into consecutive non-empty stages ``s..``
    with every unit within its ``lo``..``hi``; a stage starting at ``u`` may run to the first
    unit it cannot hold, so each entry is a running sum over the next stage's starts."""
    n = len(lo)
    ways = [[0] * (n + 1) for _ in range(num_stages + 1)]
    ways[num_stages][n] = 1
    for s in reversed(range(num_stages)):
        running = 0
        for u in reversed(range(n)):
            running = running + ways[s + 1][u + 1] if lo[u] <= s <= hi[u] else 0
            ways[s][u] = running
    return ways


def fitting_split(
    problem: PartitionProblem,
    memory_limit: int,
    step_ms: Callable[[tuple[int, ...]], float],
    *,
    budget_s: float = 10.0,
    optimize: str = "speed",
    objective: str = "step",
    slack: float = 0.01,
    runtime: RuntimeCosts | None = None,
) -> tuple[int, ...] | None:
    """The best contiguous split whose every rank's schedule walk fits ``memory_limit`` (Note
    [fitting memory over time]), by the planner's objective: the least ``step_ms`` among the
    fitting splits of least bottleneck; with ``objective="bottleneck"`` the least bottleneck;
    with ``optimize="memory"`` the least walked peak within ``1 + slack`` of it. None when
    there are more than ``EXACT_MAX_SPLITS`` splits, or walking them would take more than
    ``budget_s`` seconds (estimated from the first walks). Raises ``InfeasibleError`` when
    none fits. ``runtime``: how receives are posted (``rank_peak_memory``)."""
    total = count_contiguous_splits(problem)
    if total > EXACT_MAX_SPLITS:
        return None
    problem = replace(
        problem, memory_limit=None
    )  # the walk is the limit (the stage bound may exceed it)
    fits: list[
        tuple[float, int, int, tuple[int, ...]]
    ] = []  # bottleneck, walked peak, order, split
    least: int | None = None
    start = time.perf_counter()
    for walked, a in enumerate(contiguous_splits(problem), 1):
        peak = max(rank_peak_memory(problem, a, runtime=runtime))
        least = peak if least is None else min(least, peak)
        if peak <= memory_limit and not assignment_violations(problem, a):
            fits.append((evaluate(problem, a).bottleneck_ms, peak, len(fits), a))
        if walked % _CHECK_EVERY == 0 and (time.perf_counter() - start) / walked * total > budget_s:
            return None
    if least is None:
        raise InfeasibleError(
            f"no contiguous split of the {problem.num_units} units into {problem.num_stages} "
            f"stages honours the pins"
        )
    if not fits:
        unwalked = (
            ""
            if problem.is_chain
            else (
                "; splits that are not contiguous in the unit order, possible on this branching graph, were not walked"
            )
        )
        raise InfeasibleError(
            f"no contiguous split fits {_bytes(memory_limit)} per device over the whole step: the least any holds "
            f"is {_bytes(least)} (every contiguous split's schedule walk checked{unwalked})"
        )
    best = min(f[0] for f in fits)
    if optimize == "memory":
        return min(
            (f for f in fits if f[0] <= best * (1 + slack) + 1e-12),
            key=lambda f: (f[1], f[0], f[2]),
        )[3]
    if objective == "bottleneck":
        return min(
            (f for f in fits if f[0] <= best * (1 + 1e-9) + 1e-12),
            key=lambda f: (step_ms(f[3]), f[2]),
        )[3]
    return min(heapq.nsmallest(_PRICED, fits), key=lambda f: (step_ms(f[3]), f[0], f[2]))[3]


def walk_violations(
    problem: PartitionProblem,
    assignment: tuple[int, ...],
    memory_limit: int,
    runtime: RuntimeCosts | None = None,
) -> list[str]:
    """The ranks of ``assignment`` whose schedule walk is over ``memory_limit``, as violations."""
    peaks = rank_peak_memory(problem, assignment, runtime=runtime)
    return [
        f"rank {r} peaks at {peak} bytes over the step > limit {memory_limit}"
        for r, peak in enumerate(peaks)
        if peak > memory_limit
    ]


def _bytes(n: int) -> str:
    return f"{format_size(n)} ({n} bytes)"


def _with_note(status: str, note: str) -> str:
    """``status`` with its stage-bound memory clause replaced by ``note``."""
    parts = [p for p in status.split("; ") if p and not p.startswith("peak memory ")]
    return "; ".join(parts + [note])
