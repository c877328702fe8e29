"""``--schedule auto``: plan every schedule (and stages per rank) and keep the fastest that fits.

Each candidate (schedule, V) is planned on its own (its split differs: V chunks per
rank, its own activation memory), with an even share of the time limit. The chosen
plan lists every candidate in ``plan.alternatives``: its predicted step, bubble and
peak rank memory, or why it could not be planned (memory limit, microbatches).
Candidates: GPipe, 1F1B and ZB-H1 with one stage per rank, interleaved 1F1B and ZBV
with two (``virtual_stages`` restricts them to the schedules that run that many).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from fxpipe.errors import InfeasibleError, PartitionError
from fxpipe.partitioner.cost import CostModel
from fxpipe.partitioner.plan import PartitionPlan, ScheduleOption
from fxpipe.partitioner.schedule import SCHEDULES
from fxpipe.tracer.profile import ModelProfile

__all__ = ["plan_auto", "auto_candidates"]


def auto_candidates(virtual_stages: int | None = None) -> list[tuple[str, int]]:
    """(schedule, stages per rank) pairs ``auto`` tries."""
    out = []
    for name, kind in SCHEDULES.items():
        v = kind.default_virtual if virtual_stages is None else virtual_stages
        hi = kind.max_virtual
        if kind.min_virtual <= v and (hi is None or v <= hi):
            out.append((name, v))
    return out


def plan_auto(
    plan_partition: Callable[..., PartitionPlan],
    profile: ModelProfile,
    num_stages: int,
    *,
    solver: str,
    microbatches: int,
    cost: CostModel | None,
    memory_limit: int | None,
    time_limit: float,
    optimize: str,
    virtual_stages: int | None,
    objective: str = "step",
    split_at: Sequence[str] = (),
) -> PartitionPlan:
    """The fastest feasible plan over ``auto_candidates`` (by predicted step), with the others listed;
    ``plan_partition`` (``planner.plan_partition``, handed in by its caller) plans each candidate."""
    candidates = auto_candidates(virtual_stages)
    if not candidates:
        raise PartitionError(
            f"no schedule runs {virtual_stages} stages per rank; leave out --virtual-stages"
        )
    share = time_limit / len(candidates)
    plans: list[PartitionPlan] = []
    options: list[ScheduleOption] = []
    for name, v in candidates:
        try:
            plan = plan_partition(
                profile,
                num_stages,
                solver=solver,
                schedule=name,
                microbatches=microbatches,
                cost=cost,
                memory_limit=memory_limit,
                time_limit=share,
                optimize=optimize,
                virtual_stages=v,
                objective=objective,
                split_at=split_at,
            )
        except InfeasibleError as exc:
            options.append(ScheduleOption(name, v, feasible=False, note=f"does not fit: {exc}"))
            continue
        except PartitionError as exc:
            options.append(ScheduleOption(name, v, feasible=False, note=str(exc)))
            continue
        pred = plan.prediction
        assert pred is not None
        plans.append(plan)
        options.append(
            ScheduleOption(
                name,
                v,
                step_ms=pred.step_ms[name],
                bubble=pred.bubble,
                peak_memory_bytes=max(plan.rank_memory_bytes or (0,)),
                feasible=True,
                note=f"{plan.num_stages} stages on {plan.num_ranks} ranks",
                stage_times=plan.stage_times,
            )
        )
    if not plans:
        reasons = "; ".join(f"{o.schedule} (V={o.virtual_stages}): {o.note}" for o in options)
        raise InfeasibleError(f"no schedule could be planned: {reasons}")
    best = min(plans, key=lambda p: (p.step_ms, p.virtual_stages))
    chosen = tuple(
        replace(o, chosen=o.schedule == best.schedule and o.virtual_stages == best.virtual_stages)
        for o in options
    )
    note = (
        f"--schedule auto chose {best.schedule} (V={best.virtual_stages}), the least predicted step of "
        f"{sum(o.feasible for o in options)} schedules that fit"
    )
    return replace(best, alternatives=chosen, status=f"{best.status}; {note}")
