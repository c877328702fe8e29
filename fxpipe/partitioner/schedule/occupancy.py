"""How many microbatches each stage holds at once under a schedule (its activation memory).

A stage holds a microbatch's activations from its ``F`` until its last backward action:
``W`` where the backward is split (Note [split backward] in ``actions``), else ``B``.
Read from the action lists alone, so it is exact for any timing: GPipe holds all M,
1F1B ``min(M, S - i)`` on stage i, ZB-H1 ``min(M, S)``.
"""

from __future__ import annotations

import functools

from fxpipe.partitioner.schedule.actions import ActionKind, Schedule

__all__ = ["in_flight_per_stage", "schedule_in_flight"]


def in_flight_per_stage(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most microbatches forwarded and not yet released."""
    split = schedule.split_backward()
    peak = [0] * schedule.num_stages
    for acts in schedule.actions:
        live: dict[int, int] = {}
        for a in acts:
            if a.kind is ActionKind.FORWARD:
                live[a.stage] = live.get(a.stage, 0) + 1
                peak[a.stage] = max(peak[a.stage], live[a.stage])
            elif (a.kind is ActionKind.WEIGHT) or (a.kind is ActionKind.BACKWARD
                                                   and (a.stage, a.microbatch) not in split):
                live[a.stage] -= 1
    return tuple(peak)


@functools.lru_cache(maxsize=4096)
def schedule_in_flight(name: str, num_ranks: int, virtual_stages: int, microbatches: int) -> tuple[int, ...]:
    """``in_flight_per_stage`` of the named schedule (cached: the planner asks for it per stage)."""
    from fxpipe.partitioner.schedule.registry import make_schedule

    return in_flight_per_stage(make_schedule(name, num_ranks, microbatches, virtual_stages))
