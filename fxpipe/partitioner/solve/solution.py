"""``Solution``: what a solver returns, an assignment plus how much it proves about it; and
``lower_bound``, the bound every plan states its gap to."""

from __future__ import annotations

from dataclasses import dataclass

from fxpipe.partitioner.problem import PartitionProblem

__all__ = ["Solution", "lower_bound"]


@dataclass(frozen=True)
class Solution:
    """Stage of every unit (``assignment[u]``) found by ``solver``.

    ``optimal`` is True when the solver proved no assignment has a smaller bottleneck
    (under its own cost model, see each solver); ``bound_ms`` is the best lower bound it
    proved on the bottleneck, if any; ``status`` is a short human-readable note.
    """

    assignment: tuple[int, ...]
    solver: str
    optimal: bool = False
    bound_ms: float | None = None
    seconds: float = 0.0
    status: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "assignment", tuple(int(s) for s in self.assignment))


def lower_bound(
    problem: PartitionProblem, *, proven: dict[str, float] | None = None
) -> tuple[float, dict[str, float]]:
    """The best lower bound on the bottleneck (ms) and the bounds it is the max of.

    * ``average``: total compute over the summed device speeds (communication-free);
    * ``largest_unit``: no unit is split, so the costliest one on the fastest device;
    * ``pigeonhole``: of the S+1 costliest units two share a stage (equal speeds only);
    * anything in ``proven`` (the chain DP's optimum, CP-SAT's proven bound).
    """
    speeds = problem.speeds
    S = problem.num_stages
    times = sorted((f + b for f, b in zip(problem.fwd_ms, problem.bwd_ms)), reverse=True)
    parts = {
        "average": sum(times) / sum(speeds),
        "largest_unit": times[0] / max(speeds),
    }
    if len(times) > S and len(set(speeds)) == 1:
        parts["pigeonhole"] = (times[S - 1] + times[S]) / speeds[0]
    for name, value in (proven or {}).items():
        parts[name] = value
    return max(parts.values()), parts
