"""The runtime's view of schedules: the planner's schedules-as-data (``fxpipe.partitioner.schedule``).

A schedule is a value: per pipeline rank, the list of actions it runs (``F``, ``B`` and,
for zero-bubble schedules, ``W``; Note [split backward] in
``fxpipe.partitioner.schedule.actions``). The runtime only executes the lists
(``fxpipe.runtime.pipeline.executor``): communication is implied by the actions (Note [implied
communication] in ``fxpipe.runtime.pipeline.stage_io``). The same lists are what the planner
simulates, so the order it predicts is the order that runs. A user may hand the
runtime a ``Schedule`` of their own; ``validate_schedule`` checks it first.
"""

from __future__ import annotations

from fxpipe.errors import ConfigError, ScheduleError
from fxpipe.partitioner.schedule import (
    SCHEDULE_NAMES,
    Action,
    ActionKind,
    Link,
    Schedule,
    chain_links,
    format_grid,
    in_flight_per_stage,
    max_in_flight,
    simulate,
    validate_schedule,
)
from fxpipe.partitioner.schedule import make_schedule as _make

__all__ = [
    "ActionKind",
    "Action",
    "Schedule",
    "gpipe",
    "one_f_one_b",
    "make_schedule",
    "SCHEDULES",
    # the validator: PipelineRunner checks every schedule before it runs (checks, a deadlock-free
    # simulation, and a step x rank grid marking the failing step on error)
    "ScheduleError",
    "Link",
    "chain_links",
    "simulate",
    "format_grid",
    "validate_schedule",
    "max_in_flight",
    "in_flight_per_stage",
]


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards (in the same microbatch order).

    Simple and bubble-heavy; every stage keeps all M microbatches' activations
    (timeline from ``validate.simulate``, one column per unit step)::

        rank 0: 0F0 0F1 0F2 .   .   .   .   0B0 0B1 0B2
        rank 1: .   1F0 1F1 1F2 .   .   1B0 1B1 1B2 .
        rank 2: .   .   2F0 2F1 2F2 2B0 2B1 2B2 .   .

    Backwards run in forward order so the gradient messages between two stages
    arrive in the same order as the activations did.
    """
    return make_schedule("gpipe", num_stages, num_microbatches)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): warm up, then alternate one forward and one backward.

    Stage ``i`` runs ``min(S - 1 - i, M)`` warm-up forwards, then pairs
    ``F(k), B(k - warmup)``, then drains the remaining backwards. At most ``S - i``
    microbatches are in flight on stage ``i`` (vs M for GPipe), so activation memory is
    bounded by the depth of the pipeline, with the same bubble as GPipe
    (timeline from ``validate.simulate``)::

        rank 0: 0F0 0F1 0F2 .   .   0B0 0F3 0B1 .   0B2 .   0B3
        rank 1: .   1F0 1F1 .   1B0 1F2 1B1 1F3 1B2 .   1B3 .
        rank 2: .   .   2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 .   .
    """
    return make_schedule("1f1b", num_stages, num_microbatches)


SCHEDULES = SCHEDULE_NAMES


def make_schedule(
    name: str, num_ranks: int, num_microbatches: int, virtual_stages: int | None = None
) -> Schedule:
    """The schedule called ``name`` (one of ``SCHEDULE_NAMES``) for ``num_ranks`` pipeline ranks,
    with ``virtual_stages`` stages per rank (default: the schedule's least); ``ConfigError`` for an
    unknown name or a stage count it cannot run."""
    try:
        return _make(name, num_ranks, num_microbatches, virtual_stages)
    except ScheduleError as exc:
        raise ConfigError(str(exc)) from None
