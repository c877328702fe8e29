"""Plans that fit the memory limit over the whole step, not only under the solvers' stage bound.

Note [fitting memory over time]: the solvers keep each rank under ``memory_limit`` with the
linear formula of Note [stage cost] (training state plus activations times the
microbatches in flight), which is fast to evaluate inside a DP or a CP-SAT model but is
a lower bound of what the rank holds at its worst moment: the walk of the schedule's
actions (Note [memory over time]) also counts receive pools, sends kept to the step's
end, backward temporaries, gradients a split ``B`` keeps for its ``W`` and the step's
inputs. A plan whose walked peak is over the limit would run out of memory on the
device, so the planner solves again with the solvers' limit lowered by the excess
(``limit x memory_limit / peak``), at most ``ROUNDS`` more times, and keeps the first
plan whose walked peak fits. The plan records the user's limit; when no round fits, the
error says by how much the best plan misses and what to change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from fxpipe.errors import InfeasibleError
from fxpipe.partitioner.cost import format_size
from fxpipe.partitioner.plan import PartitionPlan

__all__ = ["fit_memory_over_time", "walked_peak", "ROUNDS"]

ROUNDS = 4
_ADVICE = ("raise the memory limit, add stages, plan with --devices N (its search recomputes activations where "
           "memory binds) or use more microbatches of fewer samples")


def walked_peak(plan: PartitionPlan) -> int:
    """The largest per-rank peak of ``plan``'s schedule walk (0 without a prediction)."""
    pred = plan.prediction
    return max(pred.peak_memory_bytes, default=0) if pred is not None else 0


def fit_memory_over_time(solve: Callable[[int], PartitionPlan], memory_limit: int) -> PartitionPlan:
    """The plan ``solve(limit)`` makes for the largest ``limit <= memory_limit`` tried whose schedule
    walk fits ``memory_limit`` (Note [fitting memory over time])."""
    limit, peak = memory_limit, 0
    for _ in range(ROUNDS + 1):
        try:
            plan = solve(limit)
        except InfeasibleError as exc:
            if limit == memory_limit:
                raise
            raise InfeasibleError(
                f"no split fits {format_size(memory_limit)} per device over the whole step: the best plan under "
                f"the solvers' stage bound peaks at {format_size(peak)} when its schedule runs (receive buffers, "
                f"kept sends and backward temporaries included), and a tighter bound has no split; {_ADVICE}") from exc
        peak = walked_peak(plan)
        if peak <= memory_limit:
            note = f"peak memory over the step {format_size(peak)} of {format_size(memory_limit)}"
            if limit < memory_limit:
                note += f" (solved under {format_size(limit)} so that the whole step fits)"
            return replace(plan, memory_limit=memory_limit, status=_with_note(plan.status, note))
        limit = min(limit - 1, int(limit * memory_limit / peak))
    raise InfeasibleError(
        f"no split found that fits {format_size(memory_limit)} per device over the whole step: after {ROUNDS} "
        f"solves under tighter stage bounds the plan still peaks at {format_size(peak)} when its schedule runs; "
        f"{_ADVICE}")


def _with_note(status: str, note: str) -> str:
    """``status`` with its stage-bound memory clause replaced by ``note``."""
    parts = [p for p in status.split("; ") if p and not p.startswith("peak memory ")]
    return "; ".join(parts + [note])
