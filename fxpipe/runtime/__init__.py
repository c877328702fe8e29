"""The runtime: runs a build directory's stages as a pipeline with torch.distributed.

``PipelineRunner`` is the native training API; ``launch.launcher.run_build`` starts a local
``torchrun`` job (``fxpipe run``) with ``RunOptions``; ``python -m fxpipe.runtime.launch.worker
DIR`` is the entry point each rank runs and writes a ``RunRecord`` (``run.json``).
Schedules are data (``make_schedule(name, ranks, microbatches, virtual_stages)``: GPipe, 1F1B,
interleaved 1F1B, ZB-H1, ZBV; or a ``Schedule`` of your own) checked by ``validate_schedule``.

Names load on first use, so that ``fxpipe.runtime.train.run_options`` (which the CLI's parser
reads) imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fxpipe._lazy import lazy_exports, type_checking_exports

if TYPE_CHECKING:
    from fxpipe.runtime.launch.launcher import run_build
    from fxpipe.runtime.pipeline.layout import RankLayout
    from fxpipe.runtime.train.run_options import RunOptions
    from fxpipe.runtime.train.run_record import RunRecord
    from fxpipe.runtime.pipeline.runner import PipelineRunner
    from fxpipe.runtime.pipeline.schedule import (
        Action,
        ActionKind,
        Schedule,
        gpipe,
        make_schedule,
        one_f_one_b,
    )
    from fxpipe.runtime.pipeline.schedule import (
        Link,
        ScheduleError,
        format_grid,
        max_in_flight,
        simulate,
        validate_schedule,
    )

# the names above, imported on first use (Note [one list of lazy names] in fxpipe._lazy)
_LAZY = type_checking_exports(__file__)
__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
