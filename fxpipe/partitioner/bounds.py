"""Lower bounds on the bottleneck stage time, so a plan can state its gap."""

from __future__ import annotations

from fxpipe.partitioner.problem import PartitionProblem

__all__ = ["lower_bound"]


def lower_bound(problem: PartitionProblem, *, proven: dict[str, float] | None = None) -> tuple[float, dict[str, float]]:
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
