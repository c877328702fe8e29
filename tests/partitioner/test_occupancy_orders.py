"""The in-flight counts read from one-stage-per-rank orders equal those of the built action lists."""

from __future__ import annotations

import pytest

from fxpipe.errors import ScheduleError
from fxpipe.partitioner.schedule.occupancy import in_flight_per_stage, schedule_in_flight
from fxpipe.partitioner.schedule.registry import make_schedule


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_orders_give_the_action_lists_in_flight(name: str) -> None:
    for ranks in (1, 2, 3, 4, 7):
        for microbatches in (1, 2, 3, 5, 8, 13):
            want = in_flight_per_stage(make_schedule.__wrapped__(name, ranks, microbatches, 1))
            assert schedule_in_flight(name, ranks, 1, microbatches) == want, (ranks, microbatches)


def test_sizes_without_a_schedule_are_still_refused() -> None:
    with pytest.raises(ScheduleError, match="need >= 1 rank and >= 1 microbatch"):
        schedule_in_flight("1f1b", 2, 1, 0)
    with pytest.raises(ScheduleError, match="runs 1 stages per rank, not --virtual-stages 2"):
        schedule_in_flight("zb-h1", 2, 2, 4)
