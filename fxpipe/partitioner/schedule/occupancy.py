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
            elif (a.kind is ActionKind.WEIGHT) or (
                a.kind is ActionKind.BACKWARD and (a.stage, a.microbatch) not in split
            ):
                live[a.stage] -= 1
    return tuple(peak)


def _order_in_flight(order: list[tuple[str, int]]) -> int:
    """``in_flight_per_stage`` of one stage's (kind, microbatch) order."""
    split = {m for k, m in order if k == "W"}
    live = peak = 0
    for k, m in order:
        if k == "F":
            live += 1
            peak = max(peak, live)
        elif k == "W" or (k == "B" and m not in split):
            live -= 1
    return peak


@functools.lru_cache(maxsize=4096)
def schedule_in_flight(
    name: str, num_ranks: int, virtual_stages: int, microbatches: int
) -> tuple[int, ...]:
    """``in_flight_per_stage`` of the named schedule (cached: the planner asks for it per stage). One
    stage per rank: read from the stage orders, without building the actions (the cluster search
    asks for thousands of sizes)."""
    from fxpipe.partitioner.schedule.one_chunk import ONE_CHUNK_ORDERS, stage_order
    from fxpipe.partitioner.schedule.registry import make_schedule

    if name in ONE_CHUNK_ORDERS and virtual_stages == 1 and num_ranks >= 1 and microbatches >= 1:
        return tuple(
            _order_in_flight(stage_order(name, num_ranks, microbatches, s))
            for s in range(num_ranks)
        )
    return in_flight_per_stage(make_schedule(name, num_ranks, microbatches, virtual_stages))
