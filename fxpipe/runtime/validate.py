"""The schedule validator, as the runtime uses it: ``fxpipe.partitioner.schedule.validate``.

``PipelineRunner`` validates every schedule before it runs (checks, a deadlock-free
simulation, and a step x rank grid marking the failing step on error).
"""

from __future__ import annotations

from fxpipe.errors import ScheduleError
from fxpipe.partitioner.schedule import (Link, chain_links, format_grid, in_flight_per_stage, max_in_flight,
                                         simulate, validate_schedule)

__all__ = ["ScheduleError", "Link", "chain_links", "simulate", "format_grid", "validate_schedule", "max_in_flight",
           "in_flight_per_stage"]
