"""Baseline strategies other tools use, judged under fxpipe's cost model.

* ``uniform``: equal unit counts per stage.
* ``params``: balance parameter bytes over contiguous stages (DeepSpeed's
  ``partition_method="parameters"``).
* ``greedy``: walk the units and close a stage once its measured compute time reaches
  the average still to place (torchgpipe's ``balance_by_time`` idea).

They ignore communication, memory limits and pins, as those tools do; the planner
reports any pin or memory they break.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from fxpipe.partitioner.problem import PartitionProblem
from fxpipe.partitioner.solve.solution import Solution

__all__ = ["BASELINES", "uniform_split", "params_split", "greedy_split", "run_baseline"]


def _from_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    return tuple(j for j, size in enumerate(sizes) for _ in range(size))


def uniform_split(problem: PartitionProblem) -> tuple[int, ...]:
    """Stage of each unit when every stage gets ``n // S`` or ``n // S + 1`` units."""
    n, S = problem.num_units, problem.num_stages
    return _from_sizes([n // S + (1 if j < n % S else 0) for j in range(S)])


def _linear_partition(weights: Sequence[float], S: int) -> tuple[int, ...]:
    """Contiguous split into S non-empty parts minimising the largest part's weight
    (binary search on the weight with a greedy fill; weights are >= 0)."""
    n = len(weights)

    def fill(limit: float) -> list[int] | None:
        sizes: list[int] = []
        acc, count = 0.0, 0
        for u, w in enumerate(weights):
            left_units, left_stages = n - u, S - len(sizes)
            if count and (acc + w > limit or left_units < left_stages):
                sizes.append(count)
                acc, count = 0.0, 0
            acc += w
            count += 1
            if acc > limit:
                return None
        sizes.append(count)
        if len(sizes) > S:
            return None
        while len(sizes) < S:  # split the part with most units; the max weight cannot grow
            big = max(range(len(sizes)), key=lambda j: sizes[j])
            sizes[big : big + 1] = [sizes[big] // 2, sizes[big] - sizes[big] // 2]
        return sizes

    lo, hi = max(weights, default=0.0), float(sum(weights))
    best = fill(hi)
    assert best is not None
    for _ in range(60):
        if hi - lo <= 1e-9 * max(hi, 1.0):
            break
        mid = (lo + hi) / 2
        got = fill(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    return _from_sizes(best)


def params_split(problem: PartitionProblem) -> tuple[int, ...]:
    """Balance parameter bytes (each unit's own parameters) over contiguous stages."""
    weights = [float(sum(problem.param_bytes[p] for p in ps)) for ps in problem.unit_params]
    return _linear_partition(weights, problem.num_stages)


def greedy_split(problem: PartitionProblem) -> tuple[int, ...]:
    """Close each stage at the unit boundary nearest the average compute still to place."""
    n, S = problem.num_units, problem.num_stages
    times = [f + b for f, b in zip(problem.fwd_ms, problem.bwd_ms)]
    remaining = sum(times)
    sizes: list[int] = []
    u = 0
    for j in range(S - 1):
        target = remaining / (S - j)
        acc, count = 0.0, 0
        while u < n - (S - j - 1):
            w = times[u]
            if count and acc + w / 2 > target:
                break
            acc += w
            count += 1
            u += 1
        sizes.append(count)
        remaining -= acc
    sizes.append(n - u)
    return _from_sizes(sizes)


BASELINES: dict[str, Callable[[PartitionProblem], tuple[int, ...]]] = {
    "uniform": uniform_split,
    "params": params_split,
    "greedy": greedy_split,
}


def run_baseline(name: str, problem: PartitionProblem) -> Solution:
    """One baseline as a ``Solution`` (never proven optimal)."""
    start = time.perf_counter()
    assignment = BASELINES[name](problem)
    return Solution(
        assignment=assignment,
        solver=name,
        seconds=time.perf_counter() - start,
        status="baseline heuristic",
    )
