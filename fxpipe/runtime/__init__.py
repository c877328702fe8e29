"""The runtime: runs a build directory's stages as a pipeline with torch.distributed.

``PipelineRunner`` is the native training API; ``launch.run_build`` starts a local
``torchrun`` job (``fxpipe run``); ``python -m fxpipe.runtime.worker DIR`` is the entry
point each rank runs. Schedules are data (``gpipe``, ``one_f_one_b``) checked by
``validate_schedule``.
"""

from fxpipe.runtime.launch import run_build
from fxpipe.runtime.layout import RankLayout
from fxpipe.runtime.runner import PipelineRunner
from fxpipe.runtime.schedule import Action, ActionKind, Schedule, gpipe, make_schedule, one_f_one_b
from fxpipe.runtime.validate import Link, ScheduleError, format_grid, max_in_flight, simulate, validate_schedule

__all__ = [
    "Action",
    "ActionKind",
    "Link",
    "PipelineRunner",
    "RankLayout",
    "Schedule",
    "ScheduleError",
    "format_grid",
    "gpipe",
    "make_schedule",
    "max_in_flight",
    "one_f_one_b",
    "run_build",
    "simulate",
    "validate_schedule",
]
