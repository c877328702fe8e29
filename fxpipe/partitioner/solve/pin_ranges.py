"""Stage ranges implied by manual pins and the data flow, with clear pin errors."""

from __future__ import annotations

from fxpipe.errors import PinError
from fxpipe.partitioner.problem import PartitionProblem

__all__ = ["stage_ranges"]


def stage_ranges(problem: PartitionProblem) -> tuple[list[int], list[int]]:
    """Earliest and latest stage each unit may take: data only flows to the same or a
    later stage, so a unit sits at or after every pinned ancestor and at or before every
    pinned descendant. Raises ``PinError`` when two pins contradict the graph order."""
    n, S = problem.num_units, problem.num_stages
    succ: list[list[int]] = [[] for _ in range(n)]
    for t in problem.tensors:
        for c in t.consumers:
            succ[t.producer].append(c)
    lo = [0] * n
    lo_from: list[int | None] = [None] * n  # the pinned ancestor that set lo
    for u in range(n):
        pin = problem.pins[u]
        if pin is not None and pin >= lo[u]:
            lo[u], lo_from[u] = pin, u
        for v in succ[u]:
            if lo[u] > lo[v]:
                lo[v], lo_from[v] = lo[u], lo_from[u]
    hi = [S - 1] * n
    for u in reversed(range(n)):
        for v in succ[u]:
            hi[u] = min(hi[u], hi[v])
        pin = problem.pins[u]
        if pin is not None:
            if lo[u] > pin:
                origin = lo_from[u]
                src = problem.names[origin] if origin is not None else "?"
                raise PinError(
                    f"unit {src!r} is pinned to stage {lo[u]} but feeds unit {problem.names[u]!r}, "
                    f"pinned to the earlier stage {pin}; data only flows to later stages, so pin "
                    f"{problem.names[u]!r} to a stage >= {lo[u]} or {src!r} to a stage <= {pin}"
                )
            hi[u] = min(hi[u], pin)
    return lo, hi
