"""Exact dynamic programme for contiguous splits of the topological order.

Note [chain DP]: stage j takes the units in positions ``[i, k)``. Its time is
``(P[k] - P[i]) / speed_j + cut[i] + cut[k]`` where ``P`` is the prefix sum of
fwd + bwd compute and ``cut[c]`` the message time (both directions, both ends) of the
tensors live across position ``c``. On a chain this is exactly Note [stage cost]; on a
branching graph it is a proxy (a skip tensor is charged to the stages it passes, and
sent once however many later stages read it), which is why ``auto`` follows up with
CP-SAT there and every plan is re-evaluated exactly.

Stage memory (Note [stage cost]) of ``[i, k)`` on stage j is ``state x distinct
params + buffers + activations x in flight + received bytes at i x in flight +
grad-requiring received bytes at i x (M - in flight + 1) + sent bytes at k x M``; ``dense.range_memory``
gives it for every pair. Each boundary term depends on one end only, so the split
into ``a[k] - b[i]`` below survives.

For a candidate bottleneck ``T`` the question "can the first k units fill stages
0..j?" is answered for all k at once: stage j can end at k from a reachable start
``i`` iff ``cut[i] - P[i]/speed_j <= T - cut[k] - P[k]/speed_j`` and ``[i, k)`` fits
the memory limit. Without a limit that is a prefix minimum. With one, and no
parameter shared by two units, memory is ``a[k] - b[i]`` exactly (boundary buffers
included), so "fits" is ``b[i] >= a[k] - limit`` and the test is a thresholded prefix
minimum (``dominance.ThresholdMin``, O(n log n) per stage). One test costs
O(S n log n) and a binary search on ``T`` finds the optimum to a relative 1e-10.
Shared (tied) parameters make memory depend on (i, k) jointly; those problems use
the O(S n^2) ``dense_split``, which evaluates every pair. Pins restrict where stage
j may end: all units pinned <= j before it, all pinned > j after it.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import replace

import numpy as np

from fxpipe.errors import InfeasibleError, ScheduleError
from fxpipe.partitioner.cost import format_size
from fxpipe.partitioner.solve.dense import DENSE_MAX_UNITS, cut_bytes, dense_split
from fxpipe.partitioner.solve.dominance import ThresholdMin
from fxpipe.partitioner.problem import PartitionProblem, evaluate
from fxpipe.partitioner.solve.solution import Solution

__all__ = ["solve_chain_dp", "min_memory_limit", "chain_arrays"]

_REL_TOL = 1e-10


def chain_arrays(problem: PartitionProblem) -> tuple[np.ndarray, np.ndarray]:
    """Prefix compute ``P`` (length n+1) and cut communication ``cut`` (length n+1, zero at both ends)."""
    n = problem.num_units
    compute = np.asarray(problem.fwd_ms) + np.asarray(problem.bwd_ms)
    prefix = np.concatenate(([0.0], np.cumsum(compute)))
    diff = np.zeros(n + 2)
    for t in problem.tensors:
        last = max(t.consumers)
        ms = problem.cost.message_ms(problem.cost.wire_bytes(t.nbytes)) * (
            2.0 if t.requires_grad else 1.0
        )  # fwd + grad back
        diff[t.producer + 1] += ms
        diff[last + 1] -= ms
    cut = np.cumsum(diff)[: n + 1]
    cut[0] = cut[n] = 0.0
    return prefix, cut


def _pin_masks(problem: PartitionProblem) -> list[np.ndarray]:
    """``ok[j][k]``: stage j may end at position k without breaking a pin."""
    S = problem.num_stages
    pins = np.array([-1 if p is None else p for p in problem.pins])
    before = np.concatenate(([-1], np.maximum.accumulate(pins)))  # max pin among units < k
    pins_hi = np.where(pins < 0, S, pins)
    after = np.concatenate(
        (np.minimum.accumulate(pins_hi[::-1])[::-1], [S])
    )  # min pin among units >= k
    return [(before <= j) & (after >= j + 1) for j in range(S)]


def _shares_params(problem: PartitionProblem) -> bool:
    """True when some parameter is used by more than one unit (tied weights)."""
    seen: set[int] = set()
    for ps in problem.unit_params:
        for p in ps:
            if p in seen:
                return True
            seen.add(p)
    return False


def _memory_terms(problem: PartitionProblem, stage: int) -> tuple[np.ndarray, np.ndarray]:
    """``a, b`` with ``range_memory(problem, j)[i, k] == a[k] - b[i]`` for a stage holding
    ``in_flight(stage)`` microbatches, when no parameter is shared (Note [chain DP])."""
    k_in = problem.in_flight(stage)
    start, end = problem.cut_factors(stage)
    own = np.array(
        [
            problem.state_factor * sum(problem.param_bytes[p] for p in ps)
            for ps in problem.unit_params
        ],
        dtype=float,
    )
    own += np.asarray(problem.buffer_bytes, dtype=float) + problem.activations_held(
        stage
    ) * np.asarray(problem.activation_bytes, dtype=float)
    w = np.concatenate(([0.0], np.cumsum(own)))
    recv, recv_grad, send = cut_bytes(problem)
    return (
        w + end * problem.microbatches * send,
        w - start * (k_in * recv + problem.grads_held(stage) * recv_grad),
    )


class _Chain:
    """The arrays one DP run needs, built once and tested against many bottlenecks.

    With a memory limit, ``fits[j]`` answers the exact memory test of stage j; this
    class is only used when no parameter is shared (``_split``)."""

    def __init__(self, problem: PartitionProblem, limit: float | None) -> None:
        self.problem = problem
        self.prefix, self.cut = chain_arrays(problem)
        self.speeds = np.asarray(problem.speeds)
        self.pin_ok = _pin_masks(problem)
        self.limit = limit
        self.fits: list[ThresholdMin] = []
        self.terms: list[tuple[np.ndarray, np.ndarray]] = []
        if limit is not None:
            assert not _shares_params(problem), "shared parameters need dense_split"
            by_k: dict[
                tuple[int, int, float, float], tuple[ThresholdMin, tuple[np.ndarray, np.ndarray]]
            ] = {}
            for j in range(problem.num_stages):
                key = (problem.in_flight(j), problem.activations_held(j), *problem.cut_factors(j))
                if key not in by_k:
                    a, b = _memory_terms(problem, j)
                    by_k[key] = (ThresholdMin(b, a - limit), (a, b))
                self.fits.append(by_k[key][0])
                self.terms.append(by_k[key][1])

    def _best_start(self, j: int, g: np.ndarray) -> np.ndarray:
        """``out[k]``: least ``g[i]`` over starts i < k whose stage [i, k) fits in memory."""
        if self.limit is None:
            return np.concatenate(([np.inf], np.minimum.accumulate(g)[:-1]))
        return self.fits[j].query(g)

    def reach(self, T: float) -> list[np.ndarray] | None:
        """Reachable end positions per stage at bottleneck ``T``; None when position n is not."""
        n, S = self.problem.num_units, self.problem.num_stages
        reach = np.zeros(n + 1, dtype=bool)
        reach[0] = True
        layers = []
        for j in range(S):
            start, end = self.problem.cut_factors(j)
            g = np.where(reach, start * self.cut - self.prefix / self.speeds[j], np.inf)
            best = self._best_start(j, g)
            h = T - end * self.cut - self.prefix / self.speeds[j]
            tol = _REL_TOL * max(T, 1e-12) if np.isfinite(T) else 0.0
            reach = np.isfinite(best) & (best <= h + tol) & self.pin_ok[j]
            reach[0] = False
            layers.append(reach)
            if not reach.any():
                return None
        return layers if layers[-1][n] else None

    def backtrack(self, T: float, layers: list[np.ndarray]) -> tuple[int, ...]:
        n, S = self.problem.num_units, self.problem.num_stages
        assignment = [0] * n
        k = n
        for j in reversed(range(S)):
            starts = np.arange(k)
            prev_ok = (starts == 0) if j == 0 else layers[j - 1][starts]
            if self.limit is not None:
                a, b = self.terms[j]
                prev_ok = prev_ok & (b[:k] >= a[k] - self.limit)
            a_j, b_j = self.problem.cut_factors(j)
            cost = (
                (self.prefix[k] - self.prefix[starts]) / self.speeds[j]
                + a_j * self.cut[starts]
                + b_j * self.cut[k]
            )
            cost = np.where(prev_ok, cost, np.inf)
            i = int(starts[int(np.argmin(cost))])
            assert np.isfinite(cost.min()) and cost.min() <= T * (1 + 1e-9) + 1e-12, (
                "DP backtrack lost its path"
            )
            assignment[i:k] = [j] * (k - i)
            k = i
        assert k == 0
        return tuple(assignment)

    def upper(self) -> float:
        return float(self.prefix[-1] / self.speeds.min() + 2 * self.cut.max() + 1.0)


def _min_bottleneck(chain: _Chain, lower: float = 0.0) -> tuple[float, list[np.ndarray]] | None:
    hi = chain.upper()
    layers = chain.reach(hi)
    if layers is None:
        return None
    lo = max(0.0, min(lower, hi))
    if lo > 0 and chain.reach(lo * (1 - 1e-12)) is not None:
        lo = 0.0
    while hi - lo > _REL_TOL * max(hi, 1e-9):
        mid = (lo + hi) / 2
        got = chain.reach(mid)
        if got is None:
            lo = mid
        else:
            hi, layers = mid, got
    return hi, layers


def _split(
    problem: PartitionProblem, limit: float | None, lower: float = 0.0
) -> tuple[float, tuple[int, ...]] | None:
    """Least DP bottleneck and its split with every stage's memory (``dense.range_memory``,
    boundary buffers included) within ``limit``; None when no split fits.

    Exact in both paths: the binary search over ``_Chain`` unless parameters are shared
    under a limit, where ``dense_split`` checks every (start, end) pair.
    """
    if limit is not None and _shares_params(problem):
        if problem.num_units > DENSE_MAX_UNITS:
            warnings.warn(
                f"{problem.num_units} units with shared parameters and a memory limit: the exact "
                f"split is O(n^2) in time and memory above {DENSE_MAX_UNITS} units",
                stacklevel=3,
            )
        prefix, cut = chain_arrays(problem)
        return dense_split(problem, prefix, cut, _pin_masks(problem), limit)
    chain = _Chain(problem, limit)
    found = _min_bottleneck(chain, lower)
    if found is None:
        return None
    value, layers = found
    return value, chain.backtrack(value, layers)


def solve_chain_dp(
    problem: PartitionProblem,
    *,
    optimize: str = "speed",
    slack: float = 0.01,
    lower_bound_ms: float = 0.0,
) -> Solution:
    """Best contiguous split of the topological order into ``problem.num_stages`` stages.

    Minimises the bottleneck stage time (Note [chain DP]) subject to pins and the
    memory limit; with ``optimize="memory"`` it then minimises peak stage memory among
    splits within ``1 + slack`` of that bottleneck. ``optimal`` (and ``bound_ms``) hold
    on chains, where the DP's time and memory are exact at any size. On a branching
    graph stage memory is bounded from above (``dense.cut_bytes``), so a returned plan
    always fits but a split may be missed; ``auto`` then tries CP-SAT. Raises
    ``InfeasibleError`` naming the least memory that would fit, and how many stages
    would fit the given limit.

    >>> sol = solve_chain_dp(build_problem(profile, 4))   # doctest: +SKIP
    """
    start = time.perf_counter()
    found = _split(problem, problem.stage_memory_limit, lower_bound_ms)
    if found is None:
        raise InfeasibleError(_infeasible_message(problem))
    value, assignment = found
    if optimize == "memory":
        assignment = _min_memory_at(problem, value * (1 + slack), assignment)
    # with several stages per rank under a memory limit, each stage was held to an even share of
    # it (a sufficient condition), so the optimum found is not a bound for every valid split
    exact = problem.is_chain and (problem.virtual_stages == 1 or problem.memory_limit is None)
    return Solution(
        assignment=assignment,
        solver="dp",
        optimal=exact and optimize == "speed",
        bound_ms=value if exact else None,
        seconds=time.perf_counter() - start,
        status=(
            "exact on a chain"
            if exact
            else "contiguous split; communication approximated on a branching graph"
            if not problem.is_chain
            else f"contiguous split; each stage held to 1/{problem.virtual_stages} of the memory limit"
        ),
    )


def _min_memory_at(
    problem: PartitionProblem, T: float, fallback: tuple[int, ...]
) -> tuple[int, ...]:
    """Among contiguous splits with DP bottleneck <= T, one with the least peak memory."""
    free = replace(problem, memory_limit=None)
    best = fallback
    hi = float(evaluate(free, fallback).peak_memory_bytes)
    lo = 0.0
    while hi - lo > max(1.0, 1e-4 * hi):
        mid = (lo + hi) / 2
        found = _split(problem, mid)
        if found is None or found[0] > T:
            lo = mid
        else:
            best = found[1]
            hi = min(mid, float(evaluate(free, best).peak_memory_bytes))
    return best


def min_memory_limit(problem: PartitionProblem) -> int | None:
    """The least per-device memory a contiguous split into ``num_stages`` stages needs
    (ignoring time), or None when the pins alone rule every split out."""
    free = replace(problem, memory_limit=None)
    found = _split(free, None)
    if found is None:
        return None

    def stage_peak(assignment: tuple[int, ...]) -> int:
        return max(s.memory_bytes for s in evaluate(free, assignment).stages)

    best = found[1]
    hi = stage_peak(best)
    lo = 0
    while hi - lo > max(1, hi // 10**6):
        mid = (lo + hi) // 2
        got = _split(free, mid)
        if got is None:
            lo = mid
        else:
            best = got[1]
            hi = min(mid, stage_peak(best))
    return int(hi) if problem.virtual_stages == 1 else evaluate(free, best).peak_memory_bytes


def _infeasible_message(problem: PartitionProblem) -> str:
    if problem.memory_limit is None:
        return (
            "no contiguous split satisfies the pins; check that pinned stages increase "
            "along the model's execution order"
        )
    need = min_memory_limit(problem)
    more = _stages_needed(problem)
    hint = f"use {more} stages or " if more else ""
    what = f"{problem.num_stages} stages" + (
        f" ({problem.num_ranks} ranks x {problem.virtual_stages})"
        if problem.virtual_stages > 1
        else ""
    )
    need_text = (
        f"the least that fits {what} is {format_size(need)} ({need} bytes)"
        if need is not None
        else "the pins rule out every split"
    )
    return (
        f"no split into {what} fits the memory limit of "
        f"{format_size(problem.memory_limit)} ({problem.memory_limit} bytes) per device: {need_text}; "
        f"{hint}raise the limit (or use a lighter optimizer / fewer microbatches)"
    )


def _stages_needed(problem: PartitionProblem) -> int | None:
    """The fewest pipeline ranks (up to about 4x more) whose split fits the memory limit."""
    V, ranks = problem.virtual_stages, problem.num_ranks
    for S in range(ranks + 1, min(problem.num_units // V, 4 * ranks + 8) + 1):
        trial = replace(
            problem,
            num_stages=S * V,
            cost=replace(problem.cost, device_speed=(), recompute=()),
            pins=tuple(None for _ in problem.pins),
        )
        try:
            if _split(trial, problem.stage_memory_limit) is not None:
                return S
        except ScheduleError:  # the schedule does not exist for S ranks (interleaved rounds)
            continue
    return None
