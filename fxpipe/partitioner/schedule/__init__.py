"""Pipeline schedules as data, and the one simulator of a training step.

``make_schedule(name, ranks, microbatches, virtual_stages)`` returns a ``Schedule``: per
rank, a list of ``Action`` (``"1F0"``, ``"0B3"``, ``"2W1"``). ``validate_schedule``
checks one (and prints a step x rank grid marking the failing step), ``simulate_step``
times it (Note [step simulation]); the planner predicts with it and the runtime executes
it. Pure Python: nothing here imports torch, so the CLI reads ``SCHEDULE_NAMES`` cheaply.

>>> from fxpipe.partitioner.schedule import make_schedule, validate_schedule
>>> rows = validate_schedule(make_schedule("zb-h1", 4, 8))
"""

from __future__ import annotations

from fxpipe.partitioner.schedule.actions import Action, ActionKind, Schedule
from fxpipe.partitioner.schedule.occupancy import in_flight_per_stage
from fxpipe.partitioner.schedule.one_chunk import stage_order
from fxpipe.partitioner.schedule.placement import (
    PLACEMENTS,
    placement_of,
    placements_of,
    stage_ranks,
)
from fxpipe.partitioner.schedule.registry import (
    AUTO,
    SCHEDULE_NAMES,
    SCHEDULES,
    ScheduleKind,
    compatible,
    make_schedule,
    runnable_schedules,
    schedule_kind,
)
from fxpipe.partitioner.schedule.simulator import (
    Link,
    ScheduleOp,
    SimulationStuck,
    Timeline,
    chain_links,
    simulate_step,
)
from fxpipe.partitioner.schedule.validate import (
    format_grid,
    max_in_flight,
    simulate,
    validate_schedule,
)

__all__ = [
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleKind",
    "SCHEDULES",
    "SCHEDULE_NAMES",
    "AUTO",
    "PLACEMENTS",
    "make_schedule",
    "schedule_kind",
    "compatible",
    "runnable_schedules",
    "stage_ranks",
    "placement_of",
    "placements_of",
    "Link",
    "chain_links",
    "ScheduleOp",
    "Timeline",
    "SimulationStuck",
    "simulate_step",
    "stage_order",
    "validate_schedule",
    "simulate",
    "format_grid",
    "max_in_flight",
    "in_flight_per_stage",
]
